"""The options of `python -m dflash_core train`, each with a line of help (the CLI's formatter adds defaults)."""

from __future__ import annotations

import argparse

from ..prompt_sets import BUILTIN

INITS = ("random", "target-last")


def init_spec(value: str) -> str:
    """`--init`: random, target-last or from:DIR, checked before any model loads."""
    if value in INITS or (value.startswith("from:") and len(value) > len("from:")):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: use random, target-last or from:DIR")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--target", default="embedded", metavar="ID|PATH",
                   help="target LLM: 'embedded' (SmolLM2-135M-Instruct), a folder or a hub id")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    g.add_argument("--dtype", default="float32",
                   help="the TARGET's dtype (float32: features as the fp32 app computes them; the target is "
                        "tiny, so this costs little even on a GPU, where matmuls use TF32)")
    g.add_argument("--autocast", choices=["auto", "bf16", "off"], default="auto",
                   help="bf16 autocast for the drafter's training step (fp32 master weights). auto: on CUDA, "
                        "and on CPUs with bf16 matrix units (AMX / AVX512-BF16), where a step is ~1.7x cheaper")
    g.add_argument("--threads", type=int, default=0, metavar="N", help="torch CPU threads (0: torch's own choice)")
    d = p.add_argument_group("data")
    d.add_argument("--data", default="data/smollm2-sharegpt", metavar="DIR[,DIR...]",
                   help="data folders (gzip JSONL shards); samples are deduplicated by id. DIR*K draws a "
                        "folder's samples K times per epoch")
    d.add_argument("--generate", type=int, default=0, metavar="N",
                   help="first regenerate N more replies with the target (0: none)")
    d.add_argument("--gen-out", default="", metavar="DIR", help="where --generate writes (default: the first --data)")
    d.add_argument("--gen-minutes", type=float, default=0.0, metavar="M", help="time box for --generate (0: none)")
    d.add_argument("--gen-batch", type=int, default=0, metavar="N",
                   help="generation batch (default: 256 on CUDA, 16 on CPU)")
    d.add_argument("--source", default="sharegpt",
                   help="prompt source for --generate: sharegpt, sharegpt-later, python-stdlib, pycode:DIR, "
                        "synthetic-math[:N], a ShareGPT .json or a JSONL of prompts")
    d.add_argument("--from-end", action="store_true",
                   help="take prompts from the end of the shuffled list (no overlap with a run from the start)")
    d.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="reply length cap for --generate")
    d.add_argument("--max-prompt-tokens", type=int, default=384, metavar="N",
                   help="prompt token budget for --generate: a chat's older turns are dropped to fit, a longer "
                        "prompt is left out")
    d.add_argument("--holdout-percent", type=float, default=2.0, metavar="P",
                   help="percent of samples held out for evaluation, by id hash")
    d.add_argument("--features", choices=["auto", "online", "cache"], default="auto",
                   help="target features: online (each step) or a disk cache (auto: online on CUDA, cache on CPU)")
    d.add_argument("--feature-cache", default="", metavar="DIR", help="cache folder (default: OUT/features)")
    t = p.add_argument_group("training")
    t.add_argument("--out", default="runs/drafter-x", metavar="DIR", help="checkpoint + report folder")
    t.add_argument("--resume", action="store_true", help="continue the run in --out (weights, optimizer, step)")
    t.add_argument("--steps", type=int, default=2000, metavar="N",
                   help="total optimizer steps (0: as many as --max-minutes allow)")
    t.add_argument("--max-minutes", type=float, default=0.0, metavar="M",
                   help="wall-clock budget of the training loop (0: none)")
    t.add_argument("--batch-seqs", type=int, default=8, metavar="N", help="sequences per step (one padded forward)")
    t.add_argument("--anchors-per-seq", type=int, default=8, metavar="N", help="blocks sampled per sequence")
    t.add_argument("--train-vocab", type=int, default=-1, metavar="K",
                   help="train against the K most frequent reply tokens only (a cheaper LM head; evaluation "
                        "and the checkpoint use the full vocabulary). -1: 8192 on CPU, full on CUDA; 0: full")
    t.add_argument("--keep-draft-vocab", action="store_true",
                   help="with --init from:DIR, train against (and ship) that drafter's draft vocabulary instead "
                        "of this run's most frequent tokens: fine-tuning on a narrow slice of data would narrow it")
    t.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (AdamW)")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, metavar="R",
                   help="the cosine schedule ends at lr x R")
    t.add_argument("--warmup", type=int, default=100, metavar="N", help="linear warm-up steps")
    t.add_argument("--weight-decay", type=float, default=0.01, metavar="W", help="AdamW weight decay (not on norms)")
    t.add_argument("--clip", type=float, default=1.0, metavar="C", help="gradient norm clip")
    t.add_argument("--gamma", type=float, default=None,
                   help="loss decay over block positions (default: by block size, 7 for B=16)")
    t.add_argument("--distill", type=float, default=0.0, metavar="W",
                   help="share of the loss that learns the target's whole next-token distribution over the "
                        "training head (distillation) instead of its chosen token alone (0..1; online features)")
    t.add_argument("--num-layers", type=int, default=2, metavar="N", help="drafter layers")
    t.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash",
                   help="DFlash, or DFlash 2 (dynamic convolutions and a candidate selector; from a DFlash "
                        "--init, it starts drafting as that drafter does)")
    t.add_argument("--block-size", type=int, default=16, metavar="B", help="tokens per block, the anchor included")
    t.add_argument("--target-layers", default="", metavar="I,J",
                   help="target layers whose features the drafter reads (default: spread over the target)")
    t.add_argument("--mask-token-id", type=int, default=0, metavar="ID",
                   help="the mask token (0: <|endoftext|> for SmolLM2)")
    t.add_argument("--init", type=init_spec, default="random", metavar="random|target-last|from:DIR",
                   help="the drafter's first weights: random, copies of the target's last layers, or a warm "
                        "start from an earlier drafter")
    t.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the weights, the data order and --generate")
    t.add_argument("--log-every", type=int, default=20, metavar="N", help="a line in log.jsonl every N steps")
    t.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="held-out eval every N steps (0: at the end only)")
    t.add_argument("--eval-seqs", type=int, default=64, metavar="N",
                   help="held-out samples used for teacher-forced eval")
    t.add_argument("--save-every", type=int, default=500, metavar="N",
                   help="save the checkpoint every N steps (0: at the end only)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    e = p.add_argument_group("evaluation (real speculative decoding, temperature 0)")
    e.add_argument("--eval-prompts", default="humaneval,gsm8k", metavar="SET[,SET...]",
                   help=f"prompt sets, comma-separated: JSONL files or built-in sets ({', '.join(BUILTIN)}); "
                        "the eval asks each prompt's first turn only ('none': skip)")
    e.add_argument("--eval-limit", type=int, default=8, metavar="K", help="prompts per set")
    e.add_argument("--eval-max-new-tokens", type=int, default=128, metavar="N", help="reply length cap in the eval")
