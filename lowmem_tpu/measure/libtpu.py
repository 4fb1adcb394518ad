"""The TPU compiler without a TPU: libtpu's compile-only client, reached through jax's topology API.

The only module of ``measure`` that imports jax (and only in the subprocess ``main`` starts; the other
is ``xla.pallas``, inside a trace), so a run, ``--help`` and the tests never load a second XLA next to
torch_xla's. :mod:`lowmem_tpu.measure.tpu_compile` starts it. It compiles one program
that torch_xla traced on the CPU backend (the ``*.before_optimizations.hlo.pb`` that
``--xla_dump_to`` writes: what torch_xla hands PJRT, shardings and buffer donors included) for a
TPU topology, and reports what the TPU compiler says about it.

Three traps (docs/tpu_compiler.md, "Three traps") would each give wrong figures without an error,
and are undone here:

- ``hlo_to_stablehlo`` drops the buffer donors: they are put back from the module's text header as
  ``jax.buffer_donor`` (else nothing aliases and every updated weight counts twice);
- without ``allow_spmd_sharding_propagation_to_output`` every output is gathered to full size;
- weights traced as torch_xla placeholders carry no sharding (``mark_sharding`` refuses data that
  does not exist): each unannotated argument gets the sharding ``place_parameters`` gives a weight
  of that shape, and the count of such arguments must equal the placeholders traced.

    python -m lowmem_tpu.measure.libtpu REQUEST.json RESULT.json   (and RESULT.hlo.txt: the optimized program)
    python -m lowmem_tpu.measure.libtpu --probe RESULT.json    (one tiny compile for v5e:1x1: doctor)
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

_DONORS = re.compile(r"buffer_donor=\{(.*?\))\s*\}")
_DONOR = re.compile(r"\((\d+),")
_TENSOR = re.compile(r"tensor<([0-9x]*?)x?([a-z]+\d*)>")


def hlo_module(wrapper: bytes) -> bytes:
    """The HloModuleProto inside the HloProto wrapper XLA dumps (its field 1), by the protobuf wire format."""
    i = 0

    def varint() -> int:
        nonlocal i
        value = shift = 0
        while True:
            byte = wrapper[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while i < len(wrapper):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 2:
            length = varint()
            if field == 1:
                return wrapper[i : i + length]
            i += length
        elif wire == 0:
            varint()
        else:
            raise ValueError(f"unexpected protobuf wire type {wire} in an HloProto")
    raise ValueError("no HloModuleProto in this file")


def buffer_donors(module_text: str) -> list[int]:
    """Parameter numbers torch_xla donated (``buffer_donor={ (1, {}), ... }`` in the module's header)."""
    header = module_text.split("\n", 1)[0]
    found = _DONORS.search(header)
    return [int(n) for n in _DONOR.findall(found.group(1))] if found else []


def fsdp_sharding(dims: list[int], devices: int, strategy: str) -> str:
    """The HLO sharding ``xla.sharding.place_parameters`` gives a weight of this shape: its largest
    dimension split over every device of the ("fsdp", "tensor") mesh (the first such dimension)."""
    if strategy != "fsdp" or devices == 1 or not dims:
        return "{replicated}"
    split = max(range(len(dims)), key=lambda k: dims[k])
    tiles = [devices if k == split else 1 for k in range(len(dims))]
    return f"{{devices=[{','.join(map(str, tiles))}]{','.join(map(str, range(devices)))}}}"


def _dims(type_text: str) -> list[int]:
    match = _TENSOR.search(type_text)
    if match is None:
        return []
    return [int(d) for d in match.group(1).split("x") if d]


def topology_devices(topology: str, host_bounds: list[int]) -> list[Any]:
    """The devices of a TPU topology ("v5e:2x4"), from libtpu's compile-only client (no TPU needed)."""
    from jax.experimental import topologies

    description = topologies.get_topology_desc(
        platform="tpu",
        topology_name=topology,
        chip_config_name="default",
        chips_per_host_bounds=tuple(host_bounds),
        num_slices=1,
        wrap=(False, False, False),
    )
    return list(description.devices)


def prepared_module(module: bytes, donors: list[int], placeholders: int, devices: int, strategy: str) -> bytes:
    """The program as StableHLO bytecode, with its donors back and the placeholders' shardings given."""
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        parsed = ir.Module.parse(_jax.mlir.hlo_to_stablehlo(module))
        main = next(op for op in parsed.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
        arguments = main.regions[0].blocks[0].arguments
        attrs = [ir.DictAttr(a) for a in ir.ArrayAttr(main.attributes["arg_attrs"])]
        unannotated = [k for k, a in enumerate(attrs) if "mhlo.sharding" not in a]
        if len(unannotated) != placeholders:
            raise ValueError(
                f"{len(unannotated)} arguments without a sharding, but {placeholders} placeholders were traced"
            )
        new = []
        for k, a in enumerate(attrs):
            entries = {a[j].name: a[j].attr for j in range(len(a))}
            if k in unannotated:
                sharding = fsdp_sharding(_dims(str(arguments[k].type)), devices, strategy)
                entries["mhlo.sharding"] = ir.StringAttr.get(sharding)
            if k in donors:
                entries["jax.buffer_donor"] = ir.BoolAttr.get(True)
            new.append(ir.DictAttr.get(entries))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(new)
        return mlir.module_to_bytecode(parsed)


def libtpu_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("libtpu")
    except PackageNotFoundError:
        return "unknown"


def compile_module(request: dict[str, Any]) -> dict[str, Any]:
    """Compile the traced program for ``request["topology"]`` and return the TPU compiler's figures.

    A refusal (RESOURCE_EXHAUSTED) is a result: its message comes back as ``error``.
    """
    import numpy as np
    from jax._src import compiler
    from jax._src.lib import _jax

    wrapper = Path(request["module"]).read_bytes()
    text = Path(request["module_text"]).read_text()
    started = time.perf_counter()
    devices = topology_devices(request["topology"], request["host_bounds"])
    n = request["devices"]
    if len(devices) != n:
        raise ValueError(f"topology {request['topology']} has {len(devices)} chips, the program {n} partitions")
    donors = buffer_donors(text)
    module = prepared_module(hlo_module(wrapper), donors, request["placeholders"], n, request["strategy"])
    options = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=n,
        device_assignment=np.array([d.id for d in devices]).reshape(1, n),
        use_spmd_partitioning=True,
    )
    build = options.executable_build_options
    build.allow_spmd_sharding_propagation_to_output = [True]  # as torch_xla sets it
    build.use_shardy_partitioner = False  # jax 0.7's default reads sdy.sharding and ignores mhlo.sharding
    client = devices[0].client
    record: dict[str, Any] = {"libtpu": libtpu_version(), "donors": len(donors), "kind": devices[0].device_kind}
    try:
        executable = client.compile(module, _jax.DeviceList(tuple(devices)), options)  # compiles, loads nothing
    except Exception as err:  # the compiler's refusal (XlaRuntimeError), among others
        record |= {"error": str(err)[:4000], "compile_seconds": round(time.perf_counter() - started, 2)}
        return record
    record["compile_seconds"] = round(time.perf_counter() - started, 2)
    stats = executable.get_compiled_memory_stats()
    record["stats"] = {
        key: int(getattr(stats, key))
        for key in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
            "temp_size_in_bytes",
            "generated_code_size_in_bytes",
            "host_argument_size_in_bytes",
            "host_output_size_in_bytes",
            "host_temp_size_in_bytes",
            "peak_memory_in_bytes",
        )
        if hasattr(stats, key)
    }
    record["cost"] = _cost(executable)
    # The optimized program with the backend configs codegen filled in (each fusion's estimated_cycles):
    # what measure.hlo_cost sums. Written beside the result by main, not into it.
    record["program"] = executable.hlo_modules()[0].to_string()
    return record


def _cost(executable: Any) -> dict[str, float]:
    """What the executable's cost analysis reports (flops, bytes accessed, ...), summed over its programs."""
    try:
        analysis = executable.cost_analysis()
    except Exception:  # not every client implements it
        return {}
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else {}
    # Per-operand entries ("bytes accessed3{}", "utilization12{}") are left out: the totals matter here.
    return {k: float(v) for k, v in (analysis or {}).items() if "{" not in k and isinstance(v, int | float)}


PROBE = """
module @probe {
  func.func public @main(%x: tensor<8x128xf32>) -> tensor<8x128xf32> {
    %y = stablehlo.add %x, %x : tensor<8x128xf32>
    return %y : tensor<8x128xf32>
  }
}
"""


def probe() -> dict[str, Any]:
    """One tiny program compiled for Colab's v5e-1 (v5e:1x1): is the TPU compiler usable here?"""
    from jax._src import compiler
    from jax._src.lib import _jax

    started = time.perf_counter()
    devices = topology_devices("v5e:1x1", [1, 1, 1])
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1, device_assignment=[[devices[0].id]])
    executable = devices[0].client.compile(PROBE.encode(), _jax.DeviceList(tuple(devices)), options)
    stats = executable.get_compiled_memory_stats()
    seconds = round(time.perf_counter() - started, 2)
    return {
        "libtpu": libtpu_version(),
        "kind": devices[0].device_kind,
        "seconds": seconds,
        "argument_bytes": int(stats.argument_size_in_bytes),
    }


def main(request_path: str, result_path: str) -> None:
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server here: do not wait for one
    # libtpu takes /tmp/libtpu_lockfile for the chips; a compile-only client opens none, so a second
    # compile (or a training run holding the TPU) must not refuse it ("Internal error when accessing
    # libtpu multi-process lockfile", measured with two compiles at once).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    record = probe() if request_path == "--probe" else compile_module(json.loads(Path(request_path).read_text()))
    program = record.pop("program", None)
    if program is not None:
        Path(result_path).with_suffix(".hlo.txt").write_text(program)
    Path(result_path).write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
