"""Open an exported graph and prove the quantizer is a real fp32 island inside it.

For every format the checks are the same, read from that format's own graph:

1. the island (the ``island`` submodule of ``vqserve.export.formats.wrappers``) is present;
2. every floating tensor computed inside it is float32 (no bf16/fp16 anywhere inside);
3. floating tensors entering it in another dtype go only into an explicit cast to float32
   (the border cast), and for bf16/fp16 graphs at least one such cast exists;
4. encode: what leaves the island is integer indices; decode: float32 codes, and (for
   bf16/fp16) the first non-layout op after it is an explicit cast to the network dtype;
5. the quantizer's decisive ops (FSQ Round, LFQ Greater, VQ ArgMin or ArgMax) are inside it and
   take float32;
6. the networks really run in the export dtype (their Conv inputs have it); an encoder
   whose residual stream is kept in fp32 (``fp32_layers`` in the manifest, default for
   bf16; ``vqserve.model.mixed_precision``) also shows float32 convolutions, and its
   latents then reach the island already in float32.

``check_island`` returns a report dict (``problems`` empty when all hold); ``IslandError``
is raised by ``assert_island``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from vqserve.export.formats.manifest import graph_roles
from vqserve.export.formats.torchscript import load_torchscript
from vqserve.model.precision import parse_dtype

ISLAND = "island"


class IslandError(ValueError):
    """The fp32 quantizer island is missing or leaky in an exported graph."""


def _report(fmt: str, role: str, dtype: str) -> dict:
    return {"format": fmt, "role": role, "dtype": dtype, "island_nodes": 0,
            "border_casts_in": 0, "border_casts_out": 0, "quantizer_ops": [],
            "island_float_dtypes": [], "network_conv_dtypes": [], "problems": []}


def _marker_ops(quantizer: str, kind: str) -> set[str]:
    """The quantizer's decisive op names in each graph language."""
    table = {
        # a VQ picks the nearest code (argmin of distances) or the best-scoring one (argmax, IBQ)
        "onnx": {"fsq": {"Round"}, "rfsq": {"Round"}, "lfq": {"Greater"}, "vq": {"ArgMin", "ArgMax"}},
        "aten": {"fsq": {"round"}, "rfsq": {"round"}, "lfq": {"gt"}, "vq": {"argmin", "argmax"}},
    }
    return table[kind][quantizer]


def _finish(rep: dict, dtype: str, role: str, quantizer: str, fp32_stream: bool = False) -> dict:
    low = dtype != "fp32"
    mixed = fp32_stream and role == "encode" and low
    if rep["island_nodes"] == 0:
        rep["problems"].append("no quantizer island found in the graph")
    if set(rep["island_float_dtypes"]) - {"float32"}:
        rep["problems"].append(f"island computes in {sorted(set(rep['island_float_dtypes']))}, not only float32")
    if low and role == "encode" and rep["border_casts_in"] == 0 and not mixed:
        rep["problems"].append("no explicit cast to float32 at the island's entry")
    if low and role == "decode" and rep["border_casts_out"] == 0:
        rep["problems"].append(f"no explicit cast from the island's float32 codes to {dtype}")
    if role == "encode" and not rep["quantizer_ops"]:
        rep["problems"].append(f"the {quantizer} quantizer's decisive op is not inside the island")
    want = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    convs = set(rep["network_conv_dtypes"])
    if not convs:
        rep["problems"].append("no convolution found outside the island")
    elif convs != {want} and not (mixed and convs == {want, "float32"}):
        rep["problems"].append(f"networks run in {sorted(convs)}, expected {want}")
    rep["island_float_dtypes"] = sorted(set(rep["island_float_dtypes"]))
    rep["network_conv_dtypes"] = sorted(convs)
    rep["quantizer_ops"] = sorted(set(rep["quantizer_ops"]))
    rep["ok"] = not rep["problems"]
    return rep


# -- ONNX ------------------------------------------------------------------------------
_ONNX_NAMES = {1: "float32", 10: "float16", 16: "bfloat16", 11: "float64"}
_LAYOUT = {"Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten"}


def check_onnx(path: str | Path, role: str, dtype: str, quantizer: str, fp32_stream: bool = False) -> dict:
    import onnx
    from onnx import TensorProto

    rep = _report("onnx", role, dtype)
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    g = model.graph
    types: dict[str, int] = {}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        types[vi.name] = vi.type.tensor_type.elem_type
    for init in g.initializer:
        types[init.name] = init.data_type
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    types[n.output[0]] = a.t.data_type

    def scope(n) -> list[str]:
        for p in n.metadata_props:
            if p.key == "pkg.torch.onnx.name_scopes":
                try:
                    return list(ast.literal_eval(p.value))
                except (ValueError, SyntaxError):
                    return []
        return []

    def cast_to(n) -> int | None:
        if n.op_type != "Cast":
            return None
        return next((a.i for a in n.attribute if a.name == "to"), None)

    island = [n for n in g.node if scope(n)[1:2] == [ISLAND]]
    inside = {o for n in island for o in n.output}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    floats = set(_ONNX_NAMES)
    want_onnx = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16}[parse_dtype(dtype)]
    markers = _marker_ops(quantizer, "onnx")
    rep["island_nodes"] = len(island)
    for n in island:
        for name in n.input:
            t = types.get(name)
            if not name or t not in floats:
                continue
            if t != TensorProto.FLOAT:
                if cast_to(n) == TensorProto.FLOAT and name not in inside:
                    rep["border_casts_in"] += 1
                else:
                    rep["problems"].append(f"{n.op_type} {n.name} inside the island takes {_ONNX_NAMES[t]}")
            elif n.op_type in markers:
                rep["quantizer_ops"].append(n.op_type)
        for name in n.output:
            t = types.get(name)
            if t in floats:
                rep["island_float_dtypes"].append(_ONNX_NAMES[t])
    outputs = {o.name for o in g.output}
    exits = [o for o in inside if o in outputs or any(c not in island for c in consumers.get(o, []))]
    for name in exits:
        t = types.get(name)
        if role == "encode" and t not in (TensorProto.INT64, TensorProto.INT32):
            rep["problems"].append(f"island output {name} is {t}, expected integer indices")
        if role == "decode":
            if t in (TensorProto.INT64, TensorProto.INT32):
                # symbolic-size arithmetic (h*w for a reshape) the exporter scoped inside the
                # island; no data leaves through it (pt2's check skips sym_size ops alike)
                continue
            if t != TensorProto.FLOAT:
                rep["problems"].append(f"island output {name} is not float32 codes")
            frontier = [c for c in consumers.get(name, []) if c not in island]
            while frontier:
                c = frontier.pop()
                if c.op_type in _LAYOUT:
                    frontier += consumers.get(c.output[0], [])
                elif cast_to(c) is not None and cast_to(c) == want_onnx != TensorProto.FLOAT:
                    rep["border_casts_out"] += 1
    for n in g.node:
        if n.op_type == "Conv" and n not in island:
            t = types.get(n.input[0])
            rep["network_conv_dtypes"].append(_ONNX_NAMES.get(t, str(t)))
    return _finish(rep, dtype, role, quantizer, fp32_stream)


# -- torch.export (pt2) -----------------------------------------------------------------
_FX_LAYOUT = {"permute", "view", "reshape", "clone", "contiguous", "_unsafe_view", "transpose",
              "expand", "alias", "detach"}
_FX_CASTS = {"to", "_to_copy", "type_as"}
_FX_IGNORE = {"_assert_tensor_metadata", "sym_size", "sym_constrain_range_for_size",
              "_assert_scalar"}


def _op_name(target) -> str:
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _in_island(node) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(str(path) == ISLAND or str(path).startswith(ISLAND + ".")
               for path, _ in stack.values())


def _val_dtype(node):
    val = node.meta.get("val")
    return getattr(val, "dtype", None)


def check_pt2(program, role: str, dtype: str, quantizer: str, fp32_stream: bool = False) -> dict:
    """``program``: a loaded ``torch.export.ExportedProgram`` (or a path to a .pt2)."""
    if isinstance(program, (str, Path)):
        program = torch.export.load(str(program))
    rep = _report("pt2", role, dtype)
    nodes = [n for n in program.graph.nodes if n.op == "call_function"
             and _op_name(n.target) not in _FX_IGNORE]
    island = {n for n in nodes if _in_island(n)}
    markers = _marker_ops(quantizer, "aten")
    rep["island_nodes"] = len(island)
    for n in island:
        op = _op_name(n.target)
        for a in n.all_input_nodes:
            dt = _val_dtype(a)
            if dt is None or not dt.is_floating_point:
                continue
            if dt != torch.float32:
                if a not in island and op in _FX_CASTS and _val_dtype(n) == torch.float32:
                    rep["border_casts_in"] += 1
                else:
                    rep["problems"].append(f"{op} inside the island takes {dt}")
            elif op in markers:
                rep["quantizer_ops"].append(op)
        dt = _val_dtype(n)
        if dt is not None and dt.is_floating_point:
            rep["island_float_dtypes"].append(str(dt).replace("torch.", ""))
    for n in island:
        users = [u for u in n.users if u not in island
                 and not (u.op == "call_function" and _op_name(u.target) in _FX_IGNORE)]
        if not users:
            continue
        dt = _val_dtype(n)
        if role == "encode" and (dt is None or dt.is_floating_point):
            rep["problems"].append(f"island output {n.name} is {dt}, expected integer indices")
        if role == "decode":
            if dt != torch.float32:
                rep["problems"].append(f"island output {n.name} is {dt}, expected float32 codes")
            frontier = list(users)
            while frontier:
                u = frontier.pop()
                op = _op_name(u.target) if u.op == "call_function" else ""
                if op in _FX_LAYOUT:
                    frontier += list(u.users)
                elif op in _FX_CASTS and _val_dtype(u) == parse_dtype(dtype) != torch.float32:
                    rep["border_casts_out"] += 1
    for n in nodes:
        if n not in island and "conv" in _op_name(n.target):
            rep["network_conv_dtypes"].append(str(_val_dtype(n)).replace("torch.", ""))
    return _finish(rep, dtype, role, quantizer, fp32_stream)


# -- TorchScript --------------------------------------------------------------------------
_SCALAR_TYPES = {6: torch.float32, 4: torch.int64, 3: torch.int32, 11: torch.bool,
                 5: torch.float16, 15: torch.bfloat16, 7: torch.float64}


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op, input dtypes, output dtype) of every aten call on non-scalar tensors."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
        out_dt = out.dtype if isinstance(out, torch.Tensor) and out.dim() > 0 else None
        if ins or out_dt is not None:
            self.calls.append((func.overloadpacket.__name__, ins, out_dt))
        return out


def check_torchscript(module, role: str, dtype: str, quantizer: str, factor: int,
                      latent_dim: int, codebook_size: int, codes_per_position: int = 1,
                      fp32_stream: bool = False, device: str = "cpu") -> dict:
    """``module``: a loaded ``torch.jit.ScriptModule`` (or a path to a .jit file).

    Static: the island submodule exists, its input goes straight into a float32 (encode)
    or int64 (decode) cast, every cast inside targets float32 / an integer type, and its
    state is float32 / integer. Dynamic: running the island alone on compute-dtype input
    records float32 for every floating op after the border cast; running the whole artifact
    records convolutions in the export dtype and the decisive quantizer ops in float32.
    """
    if isinstance(module, (str, Path)):

        module = load_torchscript(module, device)
    rep = _report("torchscript", role, dtype)
    compute = parse_dtype(dtype)
    if not hasattr(module, ISLAND):
        rep["problems"].append("artifact has no island submodule")
        return _finish(rep, dtype, role, quantizer, fp32_stream)
    island = getattr(module, ISLAND)
    graph = island.inlined_graph
    rep["island_nodes"] = sum(1 for n in graph.nodes() if n.kind().startswith("aten::"))
    # static: casts and constants
    for n in graph.nodes():
        if n.kind() == "aten::to":
            ins = list(n.inputs())
            target = None
            for i in ins[1:3]:
                ival = i.toIValue() if i.node().kind() == "prim::Constant" else None
                if isinstance(ival, int) and not isinstance(ival, bool):
                    target = _SCALAR_TYPES.get(ival)
                    break
            if target is None or (target.is_floating_point and target != torch.float32):
                rep["problems"].append(f"island casts to {target}")
        if n.kind() == "prim::Constant" and n.output().type().kind() == "TensorType":
            t = n.output().toIValue()
            if t.dim() > 0 and t.is_floating_point() and t.dtype != torch.float32:
                rep["problems"].append(f"island holds a {t.dtype} tensor constant")
    for name, t in list(island.named_parameters()) + list(island.named_buffers()):
        if t.is_floating_point() and t.dtype != torch.float32:
            rep["problems"].append(f"island state {name} is {t.dtype}")
    first = list(graph.inputs())[1]
    uses = [u.user for u in first.uses()]
    if not uses or any(u.kind() != "aten::to" for u in uses):
        rep["problems"].append("the island's input does not go straight into an explicit cast")
    # dynamic: the island alone, fed the network dtype
    if role == "encode":
        probe = torch.randn(1, 2, 2, latent_dim).to(compute).to(device)
    else:
        shape = (1, 2, 2) + ((codes_per_position,) if codes_per_position > 1 else ())
        probe = torch.randint(0, codebook_size, shape).to(device)
    with torch.no_grad(), _Recorder() as rec:
        out = island(probe)
    for op, ins, out_dt in rec.calls:
        fl = [d for d in ins if d.is_floating_point]
        if any(d != torch.float32 for d in fl):
            if op in ("_to_copy", "to") and out_dt == torch.float32 and rep["border_casts_in"] == 0:
                rep["border_casts_in"] += 1
            else:
                rep["problems"].append(f"{op} inside the island takes {fl}")
            continue
        if out_dt is not None and out_dt.is_floating_point:
            rep["island_float_dtypes"].append(str(out_dt).replace("torch.", ""))
        if op in _marker_ops(quantizer, "aten") and fl:
            rep["quantizer_ops"].append(op)
    if role == "encode" and out.is_floating_point():
        rep["problems"].append(f"island returns {out.dtype}, expected integer indices")
    if role == "decode" and out.dtype != torch.float32:
        rep["problems"].append(f"island returns {out.dtype}, expected float32 codes")
    # dynamic: the whole artifact
    if role == "encode":
        full = torch.randint(0, 256, (1, factor, factor, 3), dtype=torch.uint8).to(device)
    else:
        full = probe[:, :1, :1]
    with torch.no_grad(), _Recorder() as rec:
        module(full)
    seen_decoder_cast = False
    for op, ins, out_dt in rec.calls:
        if "conv" in op and ins:
            rep["network_conv_dtypes"].append(str(ins[0]).replace("torch.", ""))
        if role == "decode" and op in ("_to_copy", "to") and ins == [torch.float32] and out_dt == compute \
                and compute != torch.float32 and not seen_decoder_cast:
            rep["border_casts_out"] += 1
            seen_decoder_cast = True
    return _finish(rep, dtype, role, quantizer, fp32_stream)


def check_island(artifact_dir: str | Path, manifest: dict, role: str, loaded=None) -> dict:
    """Check one graph (``role`` encode/decode) of an artifact directory. ``loaded``: the
    graph already loaded from that file (a ScriptModule / ExportedProgram), to skip a reload."""
    path = loaded if loaded is not None else Path(artifact_dir) / manifest[role]
    fmt, dtype, q = manifest["format"], manifest["dtype"], manifest["quantizer"]
    mixed = bool(manifest.get("fp32_layers"))
    if fmt == "onnx":
        return check_onnx(path, role, dtype, q, mixed)
    if fmt == "pt2":
        return check_pt2(path, role, dtype, q, mixed)
    if fmt == "torchscript":
        return check_torchscript(path, role, dtype, q, manifest["factor"], manifest["latent_dim"],
                                 manifest["codebook_size"], manifest["codes_per_position"], mixed,
                                 device=manifest.get("exported_on", "cpu") if torch.cuda.is_available() else "cpu")
    raise ValueError(f"no fp32-island check for format {fmt!r}")


def assert_island(artifact_dir: str | Path, manifest: dict, loaded: dict | None = None) -> dict:
    """Both graphs (the encode graph alone for an encode-only model); raises IslandError
    listing every problem. Returns {role: report}."""

    loaded = loaded or {}
    reports = {role: check_island(artifact_dir, manifest, role, loaded.get(role))
               for role in graph_roles(manifest)}
    problems = [f"{role}: {p}" for role, r in reports.items() for p in r["problems"]]
    if problems:
        raise IslandError("the fp32 quantizer island is not intact in the exported graph: "
                          + "; ".join(problems))
    return reports
