"""The captioning recipe's tokenizer: word-level, trained on the training captions (no download),
with [BOS] ... [EOS] added to every caption and [PAD] (id 0) for padding. It is saved beside the
exported model as tokenizer.json, which `caption` loads with `Tokenizer.from_file`.
"""

from __future__ import annotations

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "[BOS]", "[EOS]"
PAD_ID = 0  # the first special token the trainer adds


def train_tokenizer(captions: list[str]) -> Tokenizer:
    """A word-level tokenizer of the training captions (lower-cased), with [BOS] ... [EOS]."""
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD, UNK, BOS, EOS])
    tokenizer.train_from_iterator(captions, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in (BOS, EOS)],
    )
    tokenizer.enable_padding(pad_id=PAD_ID, pad_token=PAD)
    return tokenizer


def shared_tokenizer(accelerator: Accelerator, captions: list[str]) -> Tokenizer:
    """Trained once on the main process and sent to the others: word ids must agree everywhere,
    and the trainer's order for words of equal frequency is not guaranteed to."""
    payload = [train_tokenizer(captions).to_str() if accelerator.is_main_process else None]
    return Tokenizer.from_str(broadcast_object_list(payload)[0])
