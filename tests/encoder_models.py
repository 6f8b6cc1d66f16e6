"""Tiny random-weight encoder model directories (BERT family), made with mlx-vlm's own classes
and a real WordPiece tokenizer built here with ``tokenizers`` (no download): a bert, roberta or
modernbert embedder (with a sentence-transformers pooling config, or none) and bert or
xlm-roberta cross-encoders (``*ForSequenceClassification``, one label)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
from embed_models import write_pooling
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

WORDS = ("the quick brown fox jumps over lazy dog hello world what does do a is numbers add up "
         "there sleeps def return and which of these documents talk about foxes dogs").split()

# (config model_type, mlx-vlm module, HF architecture prefix, special tokens: cls sep pad unk)
FAMILIES = {
    "bert": ("bert", "bert", "Bert", ("[CLS]", "[SEP]", "[PAD]", "[UNK]")),
    "roberta": ("roberta", "xlm_roberta", "Roberta", ("<s>", "</s>", "<pad>", "<unk>")),
    "xlm-roberta": ("xlm-roberta", "xlm_roberta", "XLMRoberta", ("<s>", "</s>", "<pad>", "<unk>")),
    "modernbert": ("modernbert", "modernbert", "ModernBert", ("[CLS]", "[SEP]", "[PAD]", "[UNK]")),
}


def _tokenizer(out: Path, family: str) -> dict[str, int]:
    """A WordPiece tokenizer with the family's special tokens and pair template (BERT's marks
    the second text with token type 1; RoBERTa's doubles the separator)."""
    cls, sep, pad, unk = FAMILIES[family][3]
    specials = [pad, unk, cls, sep] if cls == "[CLS]" else [cls, pad, sep, unk]
    chars = sorted(set("".join(WORDS)) | set("?:(),+.!'"))
    vocab = {t: i for i, t in enumerate(specials + list(WORDS) + chars + [f"##{c}" for c in chars])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    pair = (f"{cls} $A {sep} $B:1 {sep}:1" if family in ("bert", "modernbert")
            else f"{cls} $A {sep} {sep} $B {sep}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=pair,
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    PreTrainedTokenizerFast(tokenizer_object=tok, cls_token=cls, sep_token=sep, pad_token=pad,
                            unk_token=unk).save_pretrained(out)
    return vocab


def make_encoder(out: Path, family: str = "bert", *, reranker: bool = False,
                 pooling: str | None = "mean", positions: int = 64, seed: int = 0) -> Path:
    """A tiny encoder at ``out``: an embedder pooled by ``pooling`` ("cls", "mean",
    "lasttoken"; None: no sentence-transformers files), or with ``reranker`` a one-label
    sequence classifier. ``positions``: its ``max_position_embeddings``."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(out, family)
    model_type, module, arch, _ = FAMILIES[family]
    pad = vocab[FAMILIES[family][3][2]]
    config = {
        "model_type": model_type,
        "architectures": [f"{arch}ForSequenceClassification" if reranker else f"{arch}Model"],
        "vocab_size": len(vocab), "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64,
        "max_position_embeddings": positions, "pad_token_id": pad,
        "type_vocab_size": 2 if family == "bert" else 1,
    }
    if family == "modernbert":
        cls_id, sep_id = vocab[FAMILIES[family][3][0]], vocab[FAMILIES[family][3][1]]
        config.update(local_attention=8, global_attn_every_n_layers=2, bos_token_id=cls_id,
                      cls_token_id=cls_id, eos_token_id=sep_id, sep_token_id=sep_id)
    if reranker:
        config.update(num_labels=1, id2label={"0": "LABEL_0"})
    classes = importlib.import_module(f"mlx_vlm.models.{module}")
    cls = classes.SequenceClassificationModel if reranker else classes.Model
    mx.random.seed(seed)
    model = cls(classes.ModelConfig.from_dict(config))
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    if pooling is not None and not reranker:
        write_pooling(out, pooling, width=32, normalize=False)
    return out
