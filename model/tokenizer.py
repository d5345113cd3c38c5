"""Project tokenizer for the toy checkpoints (model-spec §12): byte-level BPE, 4096 ids.

No model hub is reachable, so the project trains its own tokenizer on `assets/corpus.txt` and ships the
result as `assets/tokenizer.json` (the shipped file, not a rebuild, is what checkpoints use, so ids stay
stable across `tokenizers` versions). BOS/EOS/pad keep DeepSeek's official ids 0/1/2 and every
chat-encoding string of §11 is one added token, so chat encoding and parsing work unchanged.

Rebuild the asset after editing the corpus or the token layout: `python -m model.tokenizer --rebuild`.
"""

from __future__ import annotations

import argparse
import json
import operator
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS_DIR = Path(__file__).parent / "assets"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
TOKENIZER_PATH = ASSETS_DIR / "tokenizer.json"
VOCAB_SIZE = 4096

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
USER, ASSISTANT, LATEST_REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
THINK_START, THINK_END = "<think>", "</think>"
TASK_TOKENS = (
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
)
DSML = "｜DSML｜"
# The tags of §11.1 as whole tokens; the bare marker covers any other use (e.g. the `<｜DSML｜tool_calls`
# detection prefix), and leftmost-longest matching makes the whole tags win where they apply.
DSML_TAGS = (
    f"<{DSML}tool_calls>",
    f"</{DSML}tool_calls>",
    f"<{DSML}invoke",
    f"</{DSML}invoke>",  # the opening tags continue with ` name="..."`
    f"<{DSML}parameter",
    f"</{DSML}parameter>",
)
TOOL_RESULT_START, TOOL_RESULT_END = "<tool_result>", "</tool_result>"
NOISE = "<｜noise｜>"
NUM_PLACEHOLDERS = 11

# The last 32 ids, in id order, with their `special` flag. Special tokens (turn framing, task markers,
# reserved) are dropped by decode(skip_special_tokens=True); the others are text the reasoning and
# tool-call parsers must still see after decoding.
_TAIL: tuple[tuple[str, bool], ...] = (
    *((t, True) for t in (USER, ASSISTANT, LATEST_REMINDER, *TASK_TOKENS)),
    *((t, False) for t in (THINK_START, THINK_END, DSML, *DSML_TAGS, TOOL_RESULT_START, TOOL_RESULT_END)),
    (NOISE, True),
    *((f"<｜place▁holder▁no▁{i}｜>", True) for i in range(NUM_PLACEHOLDERS)),
)
TOKEN_IDS: dict[str, int] = {BOS: BOS_ID, EOS: EOS_ID, PAD: PAD_ID} | {
    t: VOCAB_SIZE - len(_TAIL) + i for i, (t, _) in enumerate(_TAIL)
}
SPECIAL_TOKENS = frozenset((BOS, EOS, PAD, *(t for t, special in _TAIL if special)))
NOISE_TOKEN_ID = TOKEN_IDS[NOISE]  # the toy V4.1 config's dspark_noise_token_id


def build_tokenizer(corpus_path: str | Path = CORPUS_PATH) -> Tokenizer:
    """Train the project tokenizer from the corpus; deterministic for a given `tokenizers` version."""
    tok = Tokenizer(models.BPE())
    # Digits in groups of at most three as in the official tokenizer, so numbers do not eat the vocabulary.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(_TAIL),
        special_tokens=[BOS, EOS, PAD],  # the trainer gives its special tokens the first ids
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen in the corpus or not
        show_progress=False,
    )
    tok.train_from_iterator([Path(corpus_path).read_text(encoding="utf-8")], trainer)
    for content, special in _TAIL:
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    # A short corpus (too few merges) or a tail string already in the BPE vocabulary shifts the tail ids.
    if tok.get_vocab_size() != VOCAB_SIZE or any(tok.token_to_id(t) != i for t, i in TOKEN_IDS.items()):
        raise ValueError(
            f"{corpus_path}: built vocabulary has {tok.get_vocab_size()} ids with the tail at "
            f"{tok.token_to_id(_TAIL[0][0])}; the layout needs exactly {VOCAB_SIZE} with the tail at "
            f"{TOKEN_IDS[_TAIL[0][0]]} (extend the corpus)"
        )
    return tok


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load a tokenizer.json (a file or a checkpoint directory holding one); default: the shipped asset."""
    path = Path(path) if path is not None else TOKENIZER_PATH
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer file at {path}")
    return Tokenizer.from_file(str(path))


def prompt_ids(tokenizer: Tokenizer, text: str, bos_id: int, add_bos: bool = True) -> list[int]:
    """The prompt of ``text`` for every entry point (offline, server, ``model.generate``): BOS exactly once.

    The tokenizer's own post-processor is bypassed (every official tokenizer.json adds a BOS, the
    project's adds none), and a text that already starts with BOS (a pre-rendered chat prompt) gets
    no second one; ``add_bos=False`` takes the text's tokens as they are.
    """
    ids = tokenizer.encode_batch([text], add_special_tokens=False)[0].ids  # encode_batch frees the GIL
    return [bos_id, *ids] if add_bos and ids[:1] != [bos_id] else ids


def write_tokenizer(out_dir: str | Path) -> None:
    """Put the shipped tokenizer.json and a matching tokenizer_config.json into a checkpoint directory."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TOKENIZER_PATH, out_dir / "tokenizer.json")
    # BOS comes from the chat encoding's text, so transformers must not add one of its own.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")


@dataclass(frozen=True)
class TextTokenizer:
    """encode/decode with DeepSeek's fixed BOS/EOS/pad ids; decode rejects ids outside the vocabulary."""

    backend: Tokenizer
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID

    @classmethod
    def load(cls, path: str | Path | None = None) -> TextTokenizer:
        return cls(load_tokenizer(path))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return prompt_ids(self.backend, text, self.bos_id, add_bos)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # The backend silently drops unknown ids and cannot take negative ones: check them here instead.
        checked = []
        for pos, value in enumerate(ids):
            try:
                i = operator.index(value)
            except TypeError:
                raise ValueError(f"token id {value!r} at position {pos} is not an integer") from None
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} at position {pos} is outside [0, {self.vocab_size})")
            checked.append(i)
        return self.backend.decode(checked, skip_special_tokens=skip_special_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check (default) or rebuild the shipped tokenizer asset.")
    parser.add_argument("--rebuild", action="store_true", help="retrain from the corpus, overwrite the asset")
    args = parser.parse_args(argv)
    built = build_tokenizer()
    if args.rebuild:
        built.save(str(TOKENIZER_PATH), pretty=True)
        print(f"wrote {TOKENIZER_PATH} ({VOCAB_SIZE} ids, noise token id {NOISE_TOKEN_ID})")
        return 0
    if built.to_str() != load_tokenizer().to_str():
        print(f"{TOKENIZER_PATH} does not match the corpus; run python -m model.tokenizer --rebuild")
        return 1
    print(f"{TOKENIZER_PATH} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
