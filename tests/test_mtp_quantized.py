"""Quantized MTP folders load as float, as their readers dequantize them: a tiny Qwen3.5 target's
`mtp.*` tensors quantized to block FP8 (float8_e4m3fn and one scale per block over the
ceil grid, edge blocks partial, `quantization_config` quant_method fp8, as Qwen3.5 FP8 and
DeepSeek checkpoints ship) or, split as mlx-vlm writes it, to MLX affine (mlx.core.quantize,
`quantization` group_size / bits, as mlx-community conversions ship) load with every weight
equal bit for bit to transformers' FP8 dequantization or mlx.core.dequantize in the target's
dtype, and speculative decoding with the loaded layer gives plain decoding's tokens (torch and
MLX). Other quantizations are refused naming what the folder declares."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.integrations.finegrained_fp8 import (  # noqa: E402
    Fp8Dequantize,
    _dequantize_fp8_weight,
)

from app.core.engine import SpecEngine  # noqa: E402
from app.core.types import SamplingParams, SpecdeckError  # noqa: E402
from app.drafters import build_drafter  # noqa: E402
from backends.heads.mtp_dequant import Affine, Fp8Blocks, Quantization, dequantized  # noqa: E402
from backends.torch.backend import TorchBackend  # noqa: E402
from tests.test_mtp import BACKENDS, PROMPT, backend_of, load, needs_mlx, qwen3_5_folder  # noqa: E402
from tests.test_mtp_folder import run, split_mtp, without_mtp  # noqa: E402

BLOCK = (16, 16)  # small blocks, so the tiny layer's weights span several, some partial
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv) as the format defines them: per block
    of the last two dimensions (edge blocks partial) scale_inv = amax / 448 and the weight is
    divided by it (transformers' Fp8Quantize, over the ceil grid)."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.nn.functional.pad(weight.float(), (0, grid[1] * block[1] - cols,
                                                      0, grid[0] * block[0] - rows))
    tiles = padded.unflatten(-1, (grid[1], block[1])).unflatten(-3, (grid[0], block[0]))
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    quantized = (tiles * scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    quantized = quantized.flatten(-2).flatten(-3, -2)[..., :rows, :cols]
    return quantized.to(torch.float8_e4m3fn).contiguous(), (1.0 / scale).float()


def transformers_reads(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                       dtype: torch.dtype) -> torch.Tensor:
    """The weight as transformers dequantizes it into a model of dtype: its load-time
    Fp8Dequantize where the blocks tile the weight; where they do not (that one derives the
    block from the grid, which holds only where they tile), its edge-aware
    _dequantize_fp8_weight in float32, rounded to dtype as load does."""
    rows, cols = weight.shape[-2:]
    if rows % block[0] == 0 and cols % block[1] == 0:
        return Fp8Dequantize(None)._dequantize_one(weight, scale_inv, output_dtype=dtype)
    return _dequantize_fp8_weight(weight, scale_inv, list(block), torch.float32).to(dtype)


def fp8_folder(folder: Path) -> Path:
    """The target's original checkpoint (vLLM's layout) with its `mtp.*` matrices in block FP8
    and the config's quantization_config, as an FP8 checkpoint ships."""
    out = folder.with_name(f"{folder.name}-FP8")
    if out.exists():
        return out
    shutil.copytree(folder, out)
    stored, quantized = load_file(str(folder / "model.safetensors")), {}
    for key, value in stored.items():
        if key.startswith("mtp.") and value.ndim >= 2:
            scale_key = f"{key}_scale_inv"
            quantized[key], quantized[scale_key] = fp8_blocks(value, BLOCK)
        else:
            quantized[key] = value
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    _edit(out, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "fmt": "e4m3", "weight_block_size": list(BLOCK)})
    return out


def mlx_quantized(split: Path, bits: int, group_size: int = 32) -> Path:
    """mlx-vlm's split with its matrices in MLX affine (bf16 weights through mx.quantize,
    those whose last dimension the groups tile, as mlx-lm's conversion picks them; experts
    stacked as switch_mlp, as mlx-vlm writes them) and the config's `quantization`, under
    both names as mlx-lm writes it."""
    import mlx.core as mx

    out = split.with_name(f"{split.name}-{bits}bit")
    if out.exists():
        return out
    shutil.copytree(split, out)
    stored: dict = {}
    for key, value in _stacked(load_file(str(split / "model.safetensors"))).items():
        array = mx.array(value.float().numpy()).astype(mx.bfloat16)
        if value.ndim >= 2 and value.shape[-1] % group_size == 0:
            module = key.removesuffix(".weight")
            stored[key], stored[f"{module}.scales"], stored[f"{module}.biases"] = mx.quantize(
                array, group_size=group_size, bits=bits)
        else:
            stored[key] = array
    mx.save_safetensors(str(out / "model.safetensors"), stored, metadata={"format": "mlx"})
    settings = {"group_size": group_size, "bits": bits}
    _edit(out, quantization=settings, quantization_config=settings)
    return out


def _stacked(tensors: dict) -> dict:
    """Per-expert `mlp.experts.{j}.{gate,up,down}_proj.weight` as MLX's stacked
    `mlp.switch_mlp.{gate,up,down}_proj.weight` [E, ...]."""
    expert = re.compile(r"(.*mlp\.)experts\.(\d+)\.(\w+_proj\.weight)$")
    out = {k: v for k, v in tensors.items() if not expert.match(k)}
    groups: dict = {}
    for key in sorted(k for k in tensors if expert.match(k)):
        head, j, part = expert.match(key).groups()
        groups.setdefault(f"{head}switch_mlp.{part}", {})[int(j)] = tensors[key]
    return out | {k: torch.stack([v[j] for j in sorted(v)]) for k, v in groups.items()}


def _edit(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-quantized")
    return {"qwen3_5": qwen3_5_folder(root), "qwen3_5_moe": qwen3_5_folder(root, moe=True)}


def module_name(key: str) -> str:
    """A stored MTP tensor's name as the MtpLayer holds it (a dense weight)."""
    own = key.removeprefix("mtp.")
    return "proj.weight" if own == "fc.weight" else f"layer.{own.removeprefix('layers.0.')}"


def held_as(held: dict, key: str) -> torch.Tensor:
    """The part of the torch MtpLayer's state that a stored tensor becomes: its module's
    weight, or its expert's rows of the fused gate_up_proj [E, 2I, H] / down_proj."""
    stacked = re.search(r"mlp\.switch_mlp\.(gate|up|down)_proj\.weight$", key)  # MLX's
    if stacked is not None:
        return _expert_part(held, slice(None), stacked[1])
    match = re.search(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", key)
    if match is None:
        return held[module_name(key)]
    return _expert_part(held, int(match[1]), match[2])


def _expert_part(held: dict, expert: int | slice, part: str) -> torch.Tensor:
    if part == "down":
        return held["layer.mlp.experts.down_proj"][expert]
    gate, up = held["layer.mlp.experts.gate_up_proj"][expert].chunk(2, dim=-2)
    return gate if part == "gate" else up


def layer_of(target, head: Path):
    """The MTP layer module the drafter built from the folder head."""
    drafter = build_drafter("mtp", target, backend=backend_of(target_backend(target)),
                            head=str(head))
    return drafter.step.layer


def target_backend(target) -> str:
    return "torch" if hasattr(target, "hf") else "mlx"


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_an_fp8_mtp_folder_loads_dequantized_as_transformers_reads_it(folders, name):
    folder = folders[name]
    head = fp8_folder(folder)
    target = TorchBackend().load(str(without_mtp(folder)), device="cpu", dtype="bfloat16")
    held = layer_of(target, head).state_dict()
    stored = load_file(str(head / "model.safetensors"))
    scaled = [k.removesuffix("_scale_inv") for k in stored if k.endswith("_scale_inv")]
    edges = [k for k in scaled if stored[k].shape[-2] % BLOCK[0] or stored[k].shape[-1] % BLOCK[1]]
    assert len(scaled) >= 7 and (edges or name == "qwen3_5")
    for key in scaled:
        expected = transformers_reads(stored[key], stored[f"{key}_scale_inv"], BLOCK,
                                      torch.bfloat16)
        assert held_as(held, key).dtype == torch.bfloat16
        assert torch.equal(held_as(held, key), expected), key


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, bits", [("qwen3_5", 4), ("qwen3_5", 8), ("qwen3_5_moe", 4)])
def test_an_mlx_quantized_mtp_folder_loads_as_mlx_dequantize_reads_it(folders, backend, name,
                                                                      bits):
    import mlx.core as mx

    head = mlx_quantized(split_mtp(folders[name]), bits)
    stored = mx.load(str(head / "model.safetensors"))
    modules = [k.removesuffix(".scales") for k in stored if k.endswith(".scales")]
    target = load(backend, without_mtp(folders[name]))
    layer = layer_of(target, head)
    held = dict(layer.state_dict()) if backend == "torch" else \
        dict(_flat(layer.parameters()))
    assert len(modules) >= 7 and (name == "qwen3_5" or any("switch_mlp" in m for m in modules))
    for module in modules:
        reference = mx.dequantize(stored[f"{module}.weight"], stored[f"{module}.scales"],
                                  stored[f"{module}.biases"], group_size=32, bits=bits)
        expected = np.array(reference.astype(mx.float32))  # the target's dtype: float32
        got = held[module_name(f"{module}.weight")] if backend == "mlx" else \
            held_as(held, f"{module}.weight")
        assert np.array_equal(np.array(got) if backend == "mlx" else got.numpy(), expected), \
            module


def _flat(parameters):
    from mlx.utils import tree_flatten

    return tree_flatten(parameters)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("form", ["fp8", "mlx-4bit"])
def test_speculative_decoding_with_a_quantized_mtp_folder_gives_plain_decodings_tokens(
        folders, backend, name, form):
    folder = folders[name]
    head = fp8_folder(folder) if form == "fp8" else mlx_quantized(split_mtp(folder), 4)
    bare = load(backend, without_mtp(folder))
    plain = list(SpecEngine(bare).generate(PROMPT, SamplingParams(max_new_tokens=16)))[-1]
    tokens, chains = run(backend, bare, str(head))
    assert tokens == plain.token_ids and len(chains) > 2


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_torch_unpacking_is_mlx_dequantize_bit_for_bit(bits, dtype):
    import mlx.core as mx

    weights = mx.random.normal((2, 8, 128), key=mx.random.key(bits)).astype(getattr(mx, dtype))
    packed, scales, biases = mx.quantize(weights, group_size=32, bits=bits)
    arrays = {"w.weight": packed, "w.scales": scales, "w.biases": biases}
    path = f"/tmp/specdeck-affine-{bits}-{dtype}.safetensors"
    mx.save_safetensors(path, arrays)
    read = load_file(path)  # torch's view of the same file: uint32 words, mlx's float scales
    form = Quantization("MLX affine", {"w.weight": Affine(32, bits)},
                        frozenset({"w.scales", "w.biases"}))
    ours = dequantized(read, form)
    reference = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
    assert set(ours) == {"w.weight"} and ours["w.weight"].dtype == getattr(torch, dtype)
    assert np.array_equal(ours["w.weight"].float().numpy(),
                          np.array(reference.astype(mx.float32)))


@pytest.mark.parametrize("library", ["torch", pytest.param("mlx", marks=needs_mlx)])
@pytest.mark.parametrize("shape", [(200, 300), (3, 136, 129)])
def test_fp8_edge_blocks_take_their_blocks_scale_as_transformers_does(library, shape):
    torch.manual_seed(0)
    weight, scale_inv = fp8_blocks(torch.randn(shape) * 3, (128, 128))
    # not the load-time Fp8Dequantize: it takes rows / grid rows as the block (100 for 200
    # rows over 2 blocks of 128), or refuses where they do not divide
    reference = _dequantize_fp8_weight(weight, scale_inv, [128, 128], torch.float32)
    form = Quantization("block FP8", {"w": Fp8Blocks((128, 128))}, frozenset({"w_scale_inv"}))
    stored = {"w": weight, "w_scale_inv": scale_inv}
    if library == "mlx":
        import mlx.core as mx

        save_file(stored, "/tmp/specdeck-fp8-edges.safetensors")
        stored = mx.load("/tmp/specdeck-fp8-edges.safetensors")
    got = dequantized(stored, form)["w"]
    assert np.array_equal(np.array(got) if library == "mlx" else got.numpy(),
                          reference.numpy())


@pytest.fixture(scope="module")
def bare_target(folders):
    return load("torch", without_mtp(folders["qwen3_5"]))


@pytest.mark.parametrize("settings, named", [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}, "'gptq'"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "'awq'"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "'bitsandbytes'"),
    ({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}, "MLX's mxfp4"),
], ids=["gptq", "awq", "bitsandbytes", "mxfp4"])
def test_another_quantization_is_refused_naming_what_the_folder_declares(
        folders, bare_target, tmp_path, settings, named):
    head = tmp_path / "other-MTP"
    shutil.copytree(split_mtp(folders["qwen3_5"]), head)
    _edit(head, **settings)
    with pytest.raises(SpecdeckError, match=f"{head}.*{named}"):
        build_drafter("mtp", bare_target, backend=backend_of("torch"), head=str(head))


def test_a_folder_packed_at_other_bits_than_its_config_says_is_refused_naming_the_module(
        folders, bare_target, tmp_path):
    head = tmp_path / "mislabelled-MTP"
    shutil.copytree(mlx_quantized(split_mtp(folders["qwen3_5"]), 4), head)
    _edit(head, quantization={"group_size": 32, "bits": 8})
    found = r"\(fc\.biases \[32, 2\] BF16, fc\.scales \[32, 2\] BF16, fc\.weight \[32, 8\] U32\)"
    with pytest.raises(SpecdeckError, match=r"fc is not MLX affine at 8 bits in groups of 32 "
                                            rf"as its config says {found}"):
        build_drafter("mtp", bare_target, backend=backend_of("torch"), head=str(head))


def test_an_fp8_folder_in_e5m2_is_refused_naming_the_dtype(folders, bare_target, tmp_path):
    head = tmp_path / "e5m2-MTP"
    shutil.copytree(fp8_folder(folders["qwen3_5"]), head)
    stored = load_file(str(head / "model.safetensors"))
    stored["mtp.fc.weight"] = stored["mtp.fc.weight"].float().to(torch.float8_e5m2)
    save_file(stored, str(head / "model.safetensors"))
    with pytest.raises(SpecdeckError, match=r"mtp\.fc\.weight_scale_inv \(F32\) scales "
                                            r"mtp\.fc\.weight \(F8_E5M2\)"):
        build_drafter("mtp", bare_target, backend=backend_of("torch"), head=str(head))
