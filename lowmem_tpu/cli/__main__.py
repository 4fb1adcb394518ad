"""``python -m lowmem_tpu.cli``."""

from lowmem_tpu.cli import main

main()
