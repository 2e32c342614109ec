"""Run an exported causal LM with ONNX Runtime on CPU (shared by export, quantize, evaluate and serving).

The model directory follows the lmforge ONNX contract (see :mod:`lmforge.export.export_onnx`):
``decoder_model.onnx`` without a KV cache, run by :class:`OrtCausalLM` (inputs ``input_ids`` / ``attention_mask``
/ ``position_ids`` int64 ``[batch, seq]``, output ``logits`` float32 ``[batch, seq, vocab]``), and ``model.onnx``
with one (the file optimum's ``ORTModelForCausalLM`` loads), run by :class:`OrtDecoderWithPast` (prefill, decode
steps, greedy generation). Both derive the position ids from the attention mask (:func:`positions_from_mask`), so
callers pass only tokens and mask.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from lmforge.errors import InputDataError

log = logging.getLogger("lmforge.onnx_runtime")

NO_PAST_FILE = "decoder_model.onnx"
"""The decoder without a KV cache (optimum's name for it, which optimum never loads before ``model.onnx``)."""
WITH_PAST_FILE = "model.onnx"
"""The decoder with a KV cache: optimum's standard file name, the one ``ORTModelForCausalLM`` loads."""


POSITION_IDS = "position_ids"


def positions_from_mask(attention_mask: np.ndarray, seq: int) -> np.ndarray:
    """Position ids ``[batch, seq]`` of the last ``seq`` tokens, as transformers' ``generate`` derives them.

    ``cumsum(mask) - 1``, and 0 where the mask is 0 (transformers 5
    ``GenerationMixin._prepare_position_ids_for_generation``; transformers 4 puts 1 there, which no unmasked token
    attends to either): a left-padded row gets the positions of the unpadded sequence.
    """
    mask = np.asarray(attention_mask, dtype=np.int64)
    positions = np.cumsum(mask, axis=-1) - 1
    positions[mask == 0] = 0
    return positions[:, mask.shape[1] - seq :]


def token_feeds(input_ids: np.ndarray, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
    """A graph's token inputs: ``input_ids``, ``attention_mask`` (``[batch, past + seq]`` with a cache) and the
    ``position_ids`` of the new tokens derived from the mask (:func:`positions_from_mask`)."""
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        POSITION_IDS: positions_from_mask(attention_mask, input_ids.shape[1]),
    }


def past_input_names(layers: int) -> list[str]:
    """Graph inputs of the cache: key then value per layer."""
    return [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def present_output_names(layers: int) -> list[str]:
    """Graph outputs of the updated cache, in the order of :func:`past_input_names`."""
    return [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def resolve_model_file(model_dir_or_file: str | Path) -> Path:
    """The no-cache graph (``decoder_model.onnx``) in a directory, or the file itself; raise if it does not exist."""
    path = Path(model_dir_or_file)
    file = path / NO_PAST_FILE if path.is_dir() else path
    if not file.is_file():
        raise InputDataError(f"ONNX model not found: {file}")
    return file


def external_data_files(model_file: str | Path) -> list[Path]:
    """Files holding the model's external tensor data (empty when every weight is inline)."""
    model_file = Path(model_file)
    model = onnx.load(str(model_file), load_external_data=False)
    locations: set[str] = set()
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for tensor in graph.initializer:
            if uses_external_data(tensor):
                locations.add(ExternalDataInfo(tensor).location)
        for node in graph.node:
            graphs.extend(attr.g for attr in node.attribute if attr.HasField("g"))
            graphs.extend(g for attr in node.attribute for g in attr.graphs)
    return [model_file.parent / loc for loc in sorted(locations)]


def model_size_bytes(model_file: str | Path) -> int:
    """Bytes on disk of the model file plus its external data files."""
    model_file = Path(model_file)
    return model_file.stat().st_size + sum(f.stat().st_size for f in external_data_files(model_file) if f.is_file())


def cpu_session(path: Path, threads: int | None = None, *, spinning: bool = True) -> ort.InferenceSession:
    """An ONNX Runtime CPU session for ``path`` after ``onnx.checker`` accepted the file.

    ``spinning=False`` stops the intra-op threads from busy-waiting after each run: a server that does Python work
    between short runs (one decode step each) gets the cores back instead of competing with idle spinners.
    """
    try:
        # Checking by path also validates external data and models over 2 GB.
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputDataError(f"{path}: not a valid ONNX model ({first})") from exc
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _seq_len(cache: np.ndarray | ort.OrtValue) -> int:
    """Positions held by one cache tensor ``[batch, heads, seq, head_dim]``."""
    return cache.shape()[2] if isinstance(cache, ort.OrtValue) else cache.shape[2]


def cache_arrays(past: Sequence[np.ndarray | ort.OrtValue]) -> list[np.ndarray]:
    """A cache as numpy arrays (those :meth:`OrtDecoderWithPast.step_bound` returned are copied out)."""
    return [value.numpy() if isinstance(value, ort.OrtValue) else value for value in past]


def _checked_step_inputs(
    input_ids: np.ndarray, attention_mask: np.ndarray, past_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and mask as int64; raise unless the mask covers the ``past_len`` cached and the new tokens."""
    input_ids = np.asarray(input_ids, dtype=np.int64)
    attention_mask = np.asarray(attention_mask, dtype=np.int64)
    if attention_mask.shape != (input_ids.shape[0], past_len + input_ids.shape[1]):
        raise ValueError(
            f"attention_mask shape {attention_mask.shape} must be [batch, past + seq] = "
            f"[{input_ids.shape[0]}, {past_len + input_ids.shape[1]}]"
        )
    return input_ids, attention_mask


class OrtCausalLM:
    """A causal LM exported to ONNX, run by an ONNX Runtime CPU session.

    Args:
        model_dir_or_file: an ONNX model directory (holding ``decoder_model.onnx``) or the ``.onnx`` file.
        threads: intra-op threads; ``None`` lets ONNX Runtime choose.
    """

    def __init__(self, model_dir_or_file: str | Path, *, threads: int | None = None) -> None:
        self.path = resolve_model_file(model_dir_or_file)
        self.session = cpu_session(self.path, threads)
        self.input_names = [i.name for i in self.session.get_inputs()]
        if "input_ids" not in self.input_names:
            raise InputDataError(f"{self.path}: graph has no 'input_ids' input (inputs: {self.input_names})")
        self._size_bytes = model_size_bytes(self.path)

    @property
    def size_bytes(self) -> int:
        """Bytes on disk: the model file plus its external data."""
        return self._size_bytes

    def logits(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Float32 logits ``[batch, seq, vocab]`` for token ids ``[batch, seq]`` (mask defaults to ones)."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be 2-D [batch, seq], got shape {input_ids.shape}")
        if attention_mask is None:
            attention_mask = np.ones_like(input_ids)
        attention_mask = np.asarray(attention_mask, dtype=np.int64)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {attention_mask.shape} differs from input_ids shape {input_ids.shape}"
            )
        feeds = token_feeds(input_ids, attention_mask)
        (logits,) = self.session.run(["logits"], {k: v for k, v in feeds.items() if k in self.input_names})
        return logits


class OrtDecoderWithPast:
    """The KV-cache decoder (``model.onnx``) run by an ONNX Runtime CPU session.

    Args:
        model_dir_or_file: an ONNX model directory (holding ``model.onnx``) or the file.
        threads: intra-op threads; ``None`` lets ONNX Runtime choose.
        spinning: let idle intra-op threads busy-wait for the next run (see :func:`cpu_session`).
    """

    def __init__(self, model_dir_or_file: str | Path, *, threads: int | None = None, spinning: bool = True) -> None:
        path = Path(model_dir_or_file)
        self.path = path / WITH_PAST_FILE if path.is_dir() else path
        if not self.path.is_file():
            raise InputDataError(f"ONNX decoder with KV cache not found: {self.path}")
        self.session = cpu_session(self.path, threads, spinning=spinning)
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.input_names = list(inputs)
        self.layers = sum(name.startswith("past_key_values.") for name in inputs) // 2
        self.past_names = past_input_names(self.layers)
        if self.layers == 0 or any(name not in inputs for name in self.past_names):
            raise InputDataError(f"{self.path}: graph inputs {list(inputs)} are not a decoder with past_key_values")
        self.present_names = present_output_names(self.layers)
        _, heads, _, head_dim = inputs[self.past_names[0]].shape
        if not isinstance(heads, int) or not isinstance(head_dim, int):
            raise InputDataError(
                f"{self.path}: past_key_values heads and head size must be static, got {heads}, {head_dim}"
            )
        self.kv_heads, self.head_dim = heads, head_dim
        self._size_bytes = model_size_bytes(self.path)

    @property
    def size_bytes(self) -> int:
        """Bytes on disk: the model file plus its external data."""
        return self._size_bytes

    def empty_past(self, batch: int) -> list[np.ndarray]:
        """A zero-length cache for ``batch`` rows (the prefill's past)."""
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), dtype=np.float32) for _ in self.past_names]

    def step(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, past: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits of the new tokens and the updated cache.

        Args:
            input_ids: new tokens ``[batch, seq]``.
            attention_mask: mask of the cached and the new tokens ``[batch, past + seq]``.
            past: the cache returned by the previous step (or :meth:`empty_past`).
        """
        input_ids, attention_mask = _checked_step_inputs(input_ids, attention_mask, past[0].shape[2])
        logits, *present = self.session.run(
            ["logits", *self.present_names], self.feeds(input_ids, attention_mask, past)
        )
        return logits, present

    def step_bound(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, past: Sequence[np.ndarray | ort.OrtValue]
    ) -> tuple[np.ndarray, list[ort.OrtValue]]:
        """:meth:`step` with the cache left in ONNX Runtime's buffers: the updated cache comes back as ``OrtValue``
        objects that the next step takes as they are (:func:`cache_arrays` turns them into arrays).

        The graph concatenates past and new keys itself, so its cache cannot be updated in place; what IO binding
        saves is the copy of the whole cache into new numpy arrays at every step (:meth:`step`'s ``run``), which
        grows with batch, layers and length (47 MB a step at batch 8 on the gpt2-124m shape at 80 positions).
        """
        past_len = _seq_len(past[0])
        input_ids, attention_mask = _checked_step_inputs(input_ids, attention_mask, past_len)
        binding = self.session.io_binding()
        for name, value in token_feeds(input_ids, attention_mask).items():
            if name in self.input_names:
                binding.bind_cpu_input(name, value)
        for name, value in zip(self.past_names, past, strict=True):
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, value)
        for name in ("logits", *self.present_names):
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        logits, *present = binding.get_outputs()
        return logits.numpy(), present

    def feeds(self, input_ids: np.ndarray, attention_mask: np.ndarray, past: list[np.ndarray]) -> dict[str, np.ndarray]:
        """The graph's inputs for one step: tokens, mask, the positions derived from the mask (when the graph takes
        them) and the past."""
        feeds = {k: v for k, v in token_feeds(input_ids, attention_mask).items() if k in self.input_names}
        return {**feeds, **dict(zip(self.past_names, past, strict=True))}

    def generate(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray | None = None,
        *,
        max_new_tokens: int,
        eos_token_id: int | None = None,
        pad_token_id: int = 0,
    ) -> np.ndarray:
        """Greedy decoding with the cache; returns the new tokens ``[batch, max_new_tokens]``.

        Prompts of different lengths are left-padded (mask 0 on the left). A row that produced
        ``eos_token_id`` continues with ``pad_token_id``; decoding stops when every row has finished,
        and the result is right-padded with ``pad_token_id`` to ``max_new_tokens`` (as ``transformers``
        ``generate`` does for the new tokens).
        """
        input_ids = np.asarray(input_ids, dtype=np.int64)
        mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
        batch = input_ids.shape[0]
        out = np.full((batch, max_new_tokens), pad_token_id, dtype=np.int64)
        finished = np.zeros(batch, dtype=bool)
        logits, past = self.step(input_ids, mask, self.empty_past(batch))
        for t in range(max_new_tokens):
            token = logits[:, -1].argmax(-1)
            token = np.where(finished, pad_token_id, token)
            out[:, t] = token
            if eos_token_id is not None:
                finished |= token == eos_token_id
                if finished.all():
                    break
            if t + 1 == max_new_tokens:
                break
            mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
            logits, past = self.step(token[:, None], mask, past)
        return out


CARRIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)

EXTERNAL_DATA_BYTES = 1_800_000_000


def copy_model_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer and config files of ``src`` into ``dst``; a source needs a tokenizer."""
    src, dst = Path(src), Path(dst)
    if not (src / "tokenizer.json").is_file():
        raise InputDataError(f"{src}: no tokenizer.json; an ONNX model directory must carry its tokenizer")
    copied = []
    for name in CARRIED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied
