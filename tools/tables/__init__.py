"""The docs' generated tables, one module per source; tools/doc_tables.py places them."""
