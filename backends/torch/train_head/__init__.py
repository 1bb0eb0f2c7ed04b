"""Train an EAGLE-3 head for a local target on this machine (torch): the runner.

Knows: the order of the work (the target answers the prompts, capturing its states; the draft
vocabulary; the head starts from the target's output rows; TTT training; held-out accuracy;
export) and the work folder that makes every part resumable. Must not know: where prompts
come from, the catalogue, surfaces (app/train drives this and registers the result).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.core.prompt import encode_prompt
from app.core.types import SpecdeckError
from backends.gguf import hf_folder
from backends.torch.backend import (
    TorchBackend,
    TorchModel,
    auto_cpu_dtype,
    cpu_has_native_bf16,
    resolve_device,
    resolve_dtype,
)
from backends.torch.head_weights.eagle import Eagle3Head
from backends.torch.train_head import data, loop
from backends.torch.train_head.export import export
from backends.torch.train_head.head import draft_ids, new_head, start_from_target
from backends.torch.train_head.vocab import coverage, draft_vocabulary
from backends.train_progress import ProgressFn, TrainProgress

HELD_OUT_EVERY = 10  # every 10th answer is held out for the accuracy report


def train_head(request: Any, on_progress: ProgressFn) -> dict[str, Any]:
    """Run an app.train.TrainRequest; returns the summary that specdeck.json also keeps."""
    started = time.monotonic()
    device = resolve_device(request.device)
    bf16 = device.startswith("cuda") or cpu_has_native_bf16()
    work = Path(request.work)
    examples = _answers(request, device, work, on_progress)
    data_seconds = time.monotonic() - started
    hf = _load_target(request.target_path, resolve_dtype("auto", device), device)
    train_set = [e for i, e in enumerate(examples) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held_out = [e for i, e in enumerate(examples) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    if not train_set:
        raise SpecdeckError("no answers to train on: give more prompts (--prompts)")
    counts = _generated_counts(train_set, hf.config.vocab_size)
    ids = draft_vocabulary(counts, min(request.draft_vocab, int(hf.config.vocab_size)))
    head = new_head(hf.config, torch.from_numpy(ids))
    start_from_target(head, hf.get_output_embeddings().weight.float(),
                      hf.model.norm.weight.float())
    frozen = _frozen(hf, head, device, bf16)
    n_layers = len(hf.model.layers)
    del hf  # the head needs only the target's embedding and output rows from here on
    head.to(device)
    settings = loop.LoopSettings(**request.loop)
    summary = loop.train(head, frozen, train_set, settings, work, device, bf16, on_progress)
    accuracy = loop.evaluate(head, frozen, held_out or train_set, settings.depth,
                             settings.batch_tokens, device, bf16)
    n_tokens = sum(len(e.tokens) for e in examples)
    n_answer = sum(len(e.tokens) - e.prompt_len for e in examples)
    result = {"method": "eagle3", "target": str(request.target_path),
              "capture_layers": list(data.capture_layers(n_layers)),
              "examples": len(examples), "held_out": len(held_out), "tokens": n_tokens,
              "answer_tokens": n_answer, "draft_vocab": len(ids),
              "head_params": sum(p.numel() for p in head.parameters()),
              "draft_vocab_coverage": round(coverage(counts, ids), 4),
              "held_out_accuracy": [round(a, 4) for a in accuracy.per_depth],
              "held_out_chain_accuracy": [round(a, 4) for a in accuracy.chained],
              "held_out_tau": round(accuracy.tau, 3),
              "train_accuracy": [round(a, 4) for a in summary["train_accuracy"]],
              "steps": summary["steps"], "settings": dataclasses.asdict(settings),
              "device": device, "data_seconds": round(data_seconds, 1),
              "seconds": round(time.monotonic() - started, 1)}
    export(head, Path(request.out), extra=result)
    on_progress(TrainProgress("saved", 1, 1, message=f"head saved to {request.out}"))
    return result


def _load_target(path: str, dtype: torch.dtype, device: str) -> Any:
    """The target's unquantized weights: the head starts from its output rows and norm."""
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(hf_folder(Path(path))), dtype=dtype)
    except (OSError, ValueError) as error:
        raise SpecdeckError(f"could not load a target from {path}: {error}") from error
    _check_layers(hf, path)
    for p in hf.parameters():
        p.requires_grad_(False)
    return hf.to(device).eval()


def _check_layers(hf: Any, path: str) -> None:
    if not hasattr(hf, "model") or not hasattr(hf.model, "layers"):
        raise SpecdeckError(f"{path} is not a decoder-only model with model.layers: an "
                            "EAGLE-3 head reads the hidden states of such a model")
    if len(hf.model.layers) < 7:
        raise SpecdeckError(f"{path} has {len(hf.model.layers)} layers; EAGLE-3 reads layers "
                            "2, N//2 and N-3, three different ones from 7 layers up")


def _answer_dtype(request: Any, device: str) -> str:
    """The dtype the target answers in: the one it decodes with (`--dtype auto` picks as
    generate does), so the head learns from the states it will read."""
    if request.dtype == "auto" and device == "cpu":
        return auto_cpu_dtype(Path(request.target_path))[0]
    return request.dtype


def _answers(request: Any, device: str, work: Path,
             on_progress: ProgressFn) -> list[data.Example]:
    """The target's answers to every prompt, from the shards already made or made now (the
    target is loaded only when a shard is missing)."""
    dtype = _answer_dtype(request, device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(hf_folder(Path(request.target_path))))
    except (OSError, ValueError) as error:
        raise SpecdeckError(f"could not load a tokenizer from {request.target_path}: "
                            f"{error}") from error
    chat = bool(getattr(tokenizer, "chat_template", None))
    encoded = [encode_prompt(tokenizer, text, chat=chat)[-request.max_prompt_tokens:]
               for text in request.prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # less padding
    _check_manifest(work, request, len(encoded), dtype)
    size = request.gen_batch
    n_shards = (len(order) + size - 1) // size
    examples: list[data.Example] = []
    started, made, model = time.monotonic(), 0, None
    for s in range(n_shards):
        path = data.shard_path(work, s)
        report = _data_report(on_progress, s * size, len(order), made, started)
        if path.is_file():
            shard = data.load_shard(path)
            report(len(shard), 0)
            examples += shard
            continue
        model = model or _answering_model(request.target_path, device, dtype)
        eos = sorted(model.eos_token_ids)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        batch = [encoded[i] for i in order[s * size:(s + 1) * size]]
        # a shard of a 1.5B target takes many minutes on 2 cores (its prompts alone take
        # minutes to read): report before reading them and after every decode step
        report(0, 0)
        shard = data.generate_examples(model.hf, batch, request.max_new_tokens, eos, pad, report)
        data.save_shard(path, shard)
        examples += shard
        made += sum(len(a.tokens) - a.prompt_len for a in shard)
    return examples


def _data_report(on_progress: ProgressFn, before: int, total: int, made: int,
                 started: float) -> data.StepFn:
    """A shard's decode steps as answering progress: prompts done, tokens written per second."""
    def report(finished: int, written: int) -> None:
        rate = (made + written) / max(time.monotonic() - started, 1e-9)
        on_progress(TrainProgress("data", before + finished, total, rate))
    return report


def _answering_model(path: str, device: str, dtype: str) -> TorchModel:
    """The target as sessions load it (fused, quantized, row-invariant)."""
    model = TorchBackend().load(path, device=device, dtype=dtype)
    _check_layers(model.hf, path)
    return model


def _check_manifest(work: Path, request: Any, n_prompts: int, dtype: str) -> None:
    wanted = {"target": str(request.target_path), "prompts": n_prompts,
              "max_new_tokens": request.max_new_tokens, "gen_batch": request.gen_batch,
              "max_prompt_tokens": request.max_prompt_tokens, "dtype": dtype}
    found = data.read_manifest(work)
    if found is not None and found != wanted:
        changed = sorted(k for k in wanted if found.get(k) != wanted[k])
        raise SpecdeckError(f"{work} holds data made with other settings ({', '.join(changed)}):"
                            " add --restart to start over, or repeat the earlier settings")
    data.write_manifest(work, wanted)


def _generated_counts(examples: list[data.Example], vocab: int) -> np.ndarray:
    """How often the target wrote each token in its answers (prompts are not its tokens)."""
    answers = [e.tokens[e.prompt_len:].numpy() for e in examples]
    return np.bincount(np.concatenate(answers), minlength=vocab)[:vocab]


def _frozen(hf: Any, head: Eagle3Head, device: str, bf16: bool) -> loop.Frozen:
    table = hf.get_input_embeddings().weight.detach()
    embed = torch.nn.Embedding.from_pretrained(table.clone(), freeze=True).to(device)
    rows = hf.get_output_embeddings().weight.detach()[draft_ids(head).to(table.device)]
    return loop.Frozen(embed, rows.to(device, torch.bfloat16 if bf16 else torch.float32))
