"""What ``sharding.scan_layers`` needs installed (the [scan] extra), checked without importing torch or jax."""

from __future__ import annotations

import importlib.metadata

from lowmem_tpu.errors import UserError


def require_scan_extra(scan_layers: bool = True, load: bool = True) -> None:
    """Refuse ``sharding.scan_layers`` without the [scan] extra, before anything is built or traced.

    torch_xla 2.9's scan keeps carries sharded alike through jax (``xb.call_jax`` needs jax and torchax).
    Its wheel ships a ``torchax`` of its own, without package metadata, that imports flax: found, but it
    does not import. ``make install-scan`` installs torchax itself, with metadata. ``load=False`` checks
    the metadata only (the parent of a trace, which keeps torchax out of its process).
    """
    if not scan_layers:
        return
    try:
        importlib.metadata.version("torchax")
        if load:
            import torchax  # noqa: F401  (imports jax)
    except (importlib.metadata.PackageNotFoundError, ImportError) as err:
        unlisted = isinstance(err, importlib.metadata.PackageNotFoundError)
        found = "torchax is not installed as a package; torch_xla's bundled copy needs flax" if unlisted else err
        raise UserError(
            f"sharding.scan_layers: needs jax and torchax ({found}); install them with: make install-scan"
        ) from None
