"""How good the trained drafter is: held-out accuracy, tau with real speculative decoding, the summary."""

from __future__ import annotations

import argparse
import copy
import os
import platform
from typing import Any

import torch

from ..drafter import DFlashDrafter
from .batch import batch_forward
from .recipe import expected_accepted
from .samples import Sample, batch_context, make_batch


@torch.no_grad()
def heldout_eval(drafter: DFlashDrafter, target: Any, samples: list[Sample], args: argparse.Namespace,
                 layer_ids: list[int]) -> dict[str, Any]:
    """Teacher-forced loss and per-position accuracy on held-out replies (fixed anchors), in fp32
    whatever the training step's autocast: the numbers then compare across runs and machines."""
    drafter.eval()
    g = torch.Generator().manual_seed(12345)
    bsz = args.block_size
    hits = torch.zeros(bsz, dtype=torch.long)
    counts = torch.zeros(bsz, dtype=torch.long)
    num = den = 0.0
    for i in range(0, len(samples), args.batch_seqs):
        made = make_batch(samples[i: i + args.batch_seqs], args.anchors_per_seq, bsz, drafter.mask_token_id,
                          args.gamma, g)
        if made is None:
            continue
        batch, used = made
        out = batch_forward(drafter, target, batch, batch_context(target, batch, used, layer_ids))
        n, d = out.row_loss(len(used))
        num += float(n.sum())
        den += float(d.sum())
        h, c = out.position_hits(bsz)
        hits += h
        counts += c
    drafter.train()
    acc = (hits.float() / counts.clamp_min(1).float()).tolist()
    return {"samples": len(samples), "loss": round(num / max(den, 1e-12), 5), "acc": [round(a, 4) for a in acc[1:]],
            "tau_est": round(expected_accepted(hits, counts), 4)}


def speculative_eval(drafter: DFlashDrafter, target: Any, sets: list[str], limit: int, max_new_tokens: int,
                     progress: bool) -> dict[str, Any]:
    """tau with REAL speculative decoding: the engine drafts, the target verifies (greedy)."""
    from ..config import GenerationConfig
    from ..engine import Engine
    from ..events import Finished, tau
    from ..prompt_sets import load_prompt_set

    # A copy: the engine casts its drafter to the target's dtype and device in place.
    engine = Engine(target, copy.deepcopy(drafter))
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, verify="full")  # tau as published
    results: dict[str, Any] = {}
    for name in sets:
        prompts = load_prompt_set(name, limit)
        accepted: list[int] = []
        blocks = tokens = 0
        seconds = 0.0
        taus = []
        for turns in prompts:
            fin = None
            for ev in engine.generate(turns[0], config):
                if isinstance(ev, Finished):
                    fin = ev
                elif ev.index > 0:  # event 0 is the prefill, not a block
                    accepted.append(ev.accepted)
            assert fin is not None
            blocks += fin.blocks
            tokens += len(fin.token_ids)
            seconds += fin.elapsed_s
            taus.append(round(fin.tau, 3))
        results[name] = {"prompts": len(prompts), "tau": round(tau(accepted), 4), "blocks": blocks,
                         "tokens": tokens, "tok_s": round(tokens / max(seconds, 1e-9), 1), "per_prompt_tau": taus}
        if progress:
            print(f"[eval] {name}: tau {results[name]['tau']:.3f} over {blocks} blocks, {len(prompts)} prompts",
                  flush=True)
    return results


def hardware(device: torch.device) -> dict[str, Any]:
    """What the run's numbers were measured on."""
    hw: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
                          "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name(device)
        hw["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        hw["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return hw


def evaluate_into(report: dict[str, Any], drafter: DFlashDrafter, target: Any, held_eval: list[Sample],
                  args: argparse.Namespace, layer_ids: list[int], progress: bool) -> None:
    """The end-of-run numbers: held-out accuracy (teacher forced) and tau with real speculative
    decoding on the evaluation prompt sets, and the hardware they were measured on."""
    if held_eval:
        report["heldout"] = heldout_eval(drafter, target, held_eval, args, layer_ids)
    sets = [s for s in args.eval_prompts.split(",") if s and s != "none"]
    if sets and args.eval_limit > 0:
        report["tau"] = speculative_eval(drafter.eval(), target, sets, args.eval_limit, args.eval_max_new_tokens,
                                         progress)
    report["hardware"] = hardware(target.device)


def summary_table(report: dict[str, Any]) -> str:
    """The report's headline numbers as aligned text lines, for the terminal."""
    tr = report.get("train", {})
    rows = [("data", f"{report['data']['samples']} samples, {report['data']['reply_tokens']} reply tokens"),
            ("steps", f"{tr.get('steps')} ({tr.get('stop')}), {tr.get('blocks_seen')} blocks, "
                      f"{tr.get('ms_per_step')} ms/step"),
            ("train acc 1/2/4/8", " / ".join(f"{a:.3f}" for a in _pick(tr.get("acc", [])))),
            ("train tau_est", f"{tr.get('tau_est')}")]
    if "heldout" in report:
        h = report["heldout"]
        rows.append(("heldout acc 1/2/4/8", " / ".join(f"{a:.3f}" for a in _pick(h["acc"]))))
        rows.append(("heldout loss / tau_est", f"{h['loss']} / {h['tau_est']}"))
    if "bigram_acc1" in report:
        rows.append(("bigram acc1", f"{report['bigram_acc1']}"))
    for name, r in (report.get("tau") or {}).items():
        rows.append((f"tau {name}", f"{r['tau']:.3f} ({r['prompts']} prompts, {r['blocks']} blocks)"))
    rows.append(("wall", f"{report['wall_seconds']} s on {report['hardware'].get('gpu') or 'cpu'}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _pick(acc: list[float]) -> list[float]:
    # Block positions 1, 2, 4, 8 (acc[0] is position 1): enough to see whether position 1 leads.
    return [acc[i] for i in (0, 1, 3, 7) if i < len(acc)]
