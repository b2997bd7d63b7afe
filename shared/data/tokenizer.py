"""The run's tokenizer (docs/architecture.md#the-worker): a byte-level BPE trained with the `tokenizers` library on
the run's arms when the run is created (vocabulary 2305 by default), or raw bytes (256).

Saved as `tokenizer.json` in the run directory and used for the life of the run. Both sides load
it: the proxy to tokenize arms at creation and to print samples, the worker to decode audits.
An existing `tokenizer.json` (e.g. GPT-2's 50,257 tokens) can be given instead of training one
(docs/data.md#the-tokenizer). Token ids are stored as uint16, or uint32 above 65,536 tokens.

What it is not: the streaming of whole arms through it (`shared/data/tokenization.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shared.run.config import ConfigError

_CHUNK = 1 << 16  # characters per encode_batch item


class RunTokenizer:
    """Encode text to token ids (uint16/uint32 numpy) and back.

    kind: "bpe" or "bytes". vocab_size: number of distinct ids (ids are in [0, vocab_size)).
    """

    def __init__(self, kind: str, hf_tokenizer=None) -> None:
        self.kind = kind
        self._tok = hf_tokenizer
        self.vocab_size = 256 if kind == "bytes" else hf_tokenizer.get_vocab_size()

    @classmethod
    def train_bpe(cls, texts: list[str], vocab_size: int) -> "RunTokenizer":
        """Train a byte-level BPE on `texts` (a list of arm texts). Deterministic for equal input."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[],
        )
        chunks = (t[i : i + _CHUNK] for t in texts for i in range(0, len(t), _CHUNK))
        tok.train_from_iterator(chunks, trainer=trainer)
        return cls("bpe", tok)

    @classmethod
    def bytes(cls) -> "RunTokenizer":
        return cls("bytes")

    def save(self, path: Path) -> None:
        if self.kind == "bytes":
            Path(path).write_text(json.dumps({"andrea_tokenizer": "bytes", "vocab_size": 256}))
        else:
            self._tok.save(str(path))

    @classmethod
    def load(cls, path: Path) -> "RunTokenizer":
        """Load `tokenizer.json`. Raises ConfigError naming the file if missing or unreadable."""
        path = Path(path)
        try:
            text = path.read_text()
            if json.loads(text).get("andrea_tokenizer") == "bytes":
                return cls.bytes()
            from tokenizers import Tokenizer

            return cls("bpe", Tokenizer.from_str(text))
        except FileNotFoundError:
            raise ConfigError(
                f"{path}: missing; the run's tokenizer is created with the run"
            ) from None
        except Exception as e:  # tokenizers raises its own exception type
            raise ConfigError(f"{path}: unreadable tokenizer ({e})") from e

    @classmethod
    def from_file(cls, path) -> "RunTokenizer":
        """A user's existing `tokenizer.json` (the `tokenizers` library's format). Raises
        ConfigError naming the file when it is missing or not a tokenizer."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"--tokenizer {path}: no such file; give 'bpe', 'bytes' or the path "
                "of an existing tokenizer.json"
            )
        return cls.load(path)

    @property
    def dtype(self):
        return np.uint16 if self.vocab_size <= 65536 else np.uint32

    def encode_pieces(self, pieces: list[str]) -> np.ndarray:
        """Token ids of the concatenation of `pieces`, each encoded on its own, as one 1-D array
        of `self.dtype`. BPE pieces are encoded in parallel by the `tokenizers` library (Rust
        threads, RAYON_NUM_THREADS); the GIL is released meanwhile."""
        if not pieces:
            return np.zeros(0, self.dtype)
        if self.kind == "bytes":
            return np.frombuffer("".join(pieces).encode("utf-8"), dtype=np.uint8).astype(self.dtype)
        enc = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)(pieces)
        return np.concatenate([np.asarray(e.ids, dtype=self.dtype) for e in enc])

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` as a 1-D array of `self.dtype`."""
        return self.encode_pieces([text[i : i + _CHUNK] for i in range(0, len(text), _CHUNK)])

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "bytes":
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._tok.decode(ids)
