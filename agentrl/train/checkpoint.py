"""Atomic checkpoints: model, optimizer, RNG states, data position and step.

Layout (:mod:`agentrl.rundir`, which also finds the latest one)::

    RUN_DIR/checkpoints/step_000007/{model.pt, optimizer.pt, rng.pt, state.json}
    RUN_DIR/checkpoints/latest          # text: "step_000007"

A model that carries a LoRA adapter (:mod:`agentrl.models.lora`) is checkpointed as its adapter only:
``adapter/`` (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``) instead of ``model.pt``, and its
optimizer state covers the adapter's parameters only (the optimizer trains nothing else). Restoring copies
the adapter tensors exactly, so a resumed LoRA run continues bit for bit; resuming a LoRA checkpoint into a
full model, or the other way round, is refused with the fix.

Checkpoints written during an SFT stage (before RL step 1) are named ``sft_000004`` (SFT step 4); they
order before every ``step_*`` checkpoint, and their ``optimizer.pt`` is the SFT optimizer's state.

A checkpoint is written into ``.tmp-step_000007`` (each file fsynced), then renamed into place, then
``latest`` is replaced atomically (write + ``os.replace``). A crash at any point leaves the previous
checkpoint intact and ``latest`` pointing at a complete directory, so a killed run loses at most the
step in flight. ``state.json`` holds ``{"step", "data_position", ...}``: ``step`` optimizer steps are
done and the next task index to draw is ``data_position``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import numpy as np
import torch

from agentrl.rundir import (
    ADAPTER_DIR,
    RunDirError,
    check_weights_file,
    checkpoint_name,
    checkpoint_root,
    exception_line,
    list_checkpoints,
    read_checkpoint_state,
    write_atomic,
)


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_fsync(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _save_model(model: Any, directory: str) -> None:
    """``model.pt`` (the full state), or ``adapter/`` for a LoRA model or gathered :class:`AdapterWeights`."""
    from agentrl.models.lora import AdapterWeights, has_lora

    if isinstance(model, torch.nn.Module) and has_lora(model):
        model = AdapterWeights.of(model)
    if isinstance(model, AdapterWeights):
        adapter = os.path.join(directory, ADAPTER_DIR)
        for path in model.save(adapter):
            _fsync_file(path)
        _fsync_dir(adapter)
    else:
        _save_fsync(model.state_dict(), os.path.join(directory, "model.pt"))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: str,
    *,
    step: int,
    data_position: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
    keep: int = 1,
    sft_step: int | None = None,
) -> str:
    """Write checkpoint ``step`` (or, with ``sft_step``, SFT checkpoint ``sft_<sft_step>``) atomically and keep
    only the newest ``keep``; returns its directory. ``model``: a module (a LoRA one is saved as its adapter),
    an object whose ``state_dict()`` is the full state, or :class:`~agentrl.models.lora.AdapterWeights`."""
    root = checkpoint_root(run_dir)
    os.makedirs(root, exist_ok=True)
    name = checkpoint_name(step, sft_step)
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".tmp-{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _save_model(model, tmp)
    _save_fsync(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    _save_fsync(rng_state(), os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
        json.dump({"step": step, "data_position": data_position, **(extra or {})}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.exists(final):  # re-saving a step (e.g. after a resume) replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)
    write_atomic(os.path.join(root, "latest"), name)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


HF_DIR = "hf"
"""The folder of a checkpoint that holds its model in the HF format (``save_pretrained``), written at the end of
a run (:func:`export_hf`)."""


def export_hf(checkpoint: str, model: torch.nn.Module, tokenizer: Any = None, chat_template: str | None = None) -> str | None:
    """Write ``model`` (the weights of ``checkpoint``) with ``save_pretrained`` (safetensors, its config) and
    ``tokenizer`` when there is one into ``checkpoint/hf``, atomically (a temporary folder renamed into place);
    returns that folder, or None for a model without ``save_pretrained`` or with a LoRA adapter (its checkpoint
    already is PEFT's format). The saved tokenizer gets ``chat_template`` (the one that renders tools as
    training did, see :meth:`~agentrl.harmony.ChatTemplateFormat.exported_chat_template`) and the end token
    the model's config names (``eos_token_id``), so transformers, vLLM and TRL stop where the model does."""
    from agentrl.models.lora import has_lora

    if not hasattr(model, "save_pretrained") or has_lora(model):
        return None
    final = os.path.join(checkpoint, HF_DIR)
    tmp = os.path.join(checkpoint, f".tmp-{HF_DIR}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        _save_tokenizer(tokenizer, tmp, chat_template, getattr(model.config, "eos_token_id", None))
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


def _save_tokenizer(tokenizer: Any, directory: str, chat_template: str | None, eos_id: Any) -> None:
    """``tokenizer.save_pretrained(directory)`` with ``chat_template`` and the end token ``eos_id`` (an int)
    set for the save only: the live tokenizer, which the run's format renders with, is left as it was."""
    before = (tokenizer.chat_template, tokenizer.eos_token)
    try:
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        if isinstance(eos_id, int) and eos_id != tokenizer.eos_token_id:
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
        tokenizer.save_pretrained(directory)
    finally:
        tokenizer.chat_template, tokenizer.eos_token = before


def _is_keyed_by_name(optimizer_state: dict[str, Any]) -> bool:
    """True for a full optimizer state keyed by parameter names (what the FSDP2 trainer writes)."""
    groups = optimizer_state.get("param_groups") or []
    return any(isinstance(p, str) for g in groups for p in g.get("params", []))


def optimizer_state_by_index(
    saved: dict[str, Any], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, source: str = "checkpoint"
) -> dict[str, Any]:
    """A name-keyed full optimizer state (``torch.distributed.checkpoint.state_dict`` layout, written by
    ``trainer.n_gpus > 1``) re-keyed by parameter index for the single-process ``optimizer`` over ``model``.

    Raises ValueError naming the parameters that differ when the two do not train the same parameters
    (e.g. another ``actor.freeze``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    ours = [[names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(g["params"])] for g in optimizer.param_groups]
    theirs = [list(g["params"]) for g in saved["param_groups"]]
    if [sorted(g) for g in ours] != [sorted(g) for g in theirs]:
        mine = {n for g in ours for n in g}
        saved_names = {n for g in theirs for n in g}
        only_saved, only_here = sorted(saved_names - mine)[:5], sorted(mine - saved_names)[:5]
        raise ValueError(
            f"{source}: its optimizer state covers other parameters than this run trains (only in the checkpoint: "
            f"{only_saved or 'none'}; only here: {only_here or 'none'}; groups {len(theirs)} vs {len(ours)}). "
            "Resume with the same model and actor.freeze as the run that wrote it"
        )
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for group_names, saved_group in zip(ours, saved["param_groups"], strict=True):
        indices = []
        for name in group_names:
            if name in saved["state"]:
                state[index] = saved["state"][name]
            indices.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": indices})
    return {"state": state, "param_groups": groups}


_FIX = "remove that checkpoint directory to resume from the one before it, or start afresh with overwrite=true"


def load_file(path: str, *, map_location: Any = None, weights_only: bool = True) -> Any:
    """``torch.load(path)``; a missing, empty, truncated or foreign file raises :class:`RunDirError`: one line
    naming the file and what to do."""
    check_weights_file(path, fix=_FIX)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as exc:  # noqa: BLE001 - torch and pickle raise many types for a damaged file
        raise RunDirError(f"{path} is not a readable checkpoint file ({exception_line(exc)}); {_FIX}") from None


def load_state_into(module: torch.nn.Module, state: Any, source: str) -> None:
    """``module.load_state_dict(state)``; weights of another model (other names or shapes) raise
    :class:`RunDirError` naming ``source`` and the first difference."""
    try:
        module.load_state_dict(state)
    except (RuntimeError, TypeError, KeyError, AttributeError) as exc:
        details = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()] or [str(exc)]
        raise RunDirError(
            f"{source} holds another model's weights ({details[0][:200]}); resume with the model= of the run that "
            "wrote it, or start a new run (run_dir=...)"
        ) from None


def load_model_state(path: str, model: torch.nn.Module) -> None:
    """Restore ``model`` from checkpoint directory ``path``: its adapter (``adapter/``) into a LoRA model, else the
    full state (``model.pt``). Works on FSDP2-sharded models too (every rank calls it). Raises ValueError when the
    checkpoint and the model disagree on LoRA (or on the adapter's settings)."""
    from agentrl.models.lora import has_lora, load_adapter

    adapter = os.path.join(path, ADAPTER_DIR)
    if os.path.isdir(adapter):
        if not has_lora(model):
            raise ValueError(f"{path} holds a LoRA adapter but this run trains the full model; resume with the "
                             "actor.lora settings of the run that wrote it")
        load_adapter(model, adapter)
        return
    if has_lora(model):
        raise ValueError(f"{path} holds full model weights (model.pt) but this run trains a LoRA adapter; resume "
                         "without actor.lora, or start a LoRA run on it with model=<its run directory>")
    device = next(model.parameters()).device
    file = os.path.join(path, "model.pt")
    load_state_into(model, load_file(file, map_location=device), file)


def load_checkpoint(path: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model, optimizer and RNG states from checkpoint directory ``path``; returns state.json.

    Checkpoints of ``trainer.n_gpus > 1`` runs load too: their model state is the full (unsharded) one
    under the same names, and their name-keyed optimizer state is re-keyed by :func:`optimizer_state_by_index`.
    """
    device = next(model.parameters()).device
    load_model_state(path, model)
    file = os.path.join(path, "optimizer.pt")
    optimizer_state = load_file(file, map_location=device)
    if _is_keyed_by_name(optimizer_state):
        try:
            optimizer_state = optimizer_state_by_index(optimizer_state, model=model, optimizer=optimizer, source=path)
        except ValueError as exc:  # its message names the parameters and the fix
            raise RunDirError(str(exc)) from None
    try:
        optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RunDirError(f"{file} does not fit this run's optimizer ({str(exc).splitlines()[0][:200]}); {_FIX}") from None
    file = os.path.join(path, "rng.pt")
    rng = load_file(file, weights_only=False)
    try:
        set_rng_state(rng)
    except (KeyError, TypeError, ValueError) as exc:
        raise RunDirError(f"{file} is not an RNG state ({type(exc).__name__}: {exc}); {_FIX}") from None
    return read_checkpoint_state(path)
