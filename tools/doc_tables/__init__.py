"""The docs' generated tables, one module per source; tools/recipe_table.py places them."""
