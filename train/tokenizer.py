"""Byte-level vocabulary: ids 0..255 are the bytes themselves, a few special ids sit above them.

No tokenizer file to ship or download: any text is its UTF-8 bytes. The vocabulary is padded to
264 (a multiple of 8) so the embedding and logit matrices tile evenly; ids 262..263 are unused.

An image in the token stream is one run `IMAGE_START_ID, IMAGE_PAD_ID x n, IMAGE_END_ID`, n its
merged image tokens (`models.vision.num_image_tokens`); the model writes the image's features
at the IMAGE_PAD_ID tokens (`train.multimodal`).

Padding is *not* id 0. grain's packers fill empty slots with 0, which is the byte NUL, so the data
pipeline marks padding through `segment_ids == 0` and `loss_mask == 0` and then overwrites those
slots with `PAD_ID`; nothing downstream should infer padding from a token id.
"""

import numpy as np

NUM_BYTES = 256
PAD_ID = 256  # empty slot of a packed row; never a prediction target
BOS_ID = 257  # first token of every document
SEP_ID = 258  # separates the parts of a synthetic-task example (context, filler, queries)
IMAGE_START_ID = 259  # opens an image's placeholder run
IMAGE_PAD_ID = 260  # one merged image token: the model's `VisionConfig.image_token_id`
IMAGE_END_ID = 261  # closes an image's placeholder run
VOCAB_SIZE = 264

_SPECIAL_NAMES = {PAD_ID: "<pad>", BOS_ID: "<bos>", SEP_ID: "<sep>",
                  IMAGE_START_ID: "<image_start>", IMAGE_PAD_ID: "<image>",
                  IMAGE_END_ID: "<image_end>"}


def encode(text: str | bytes, *, bos: bool = True) -> np.ndarray:
    """UTF-8 bytes of `text` as token ids, optionally led by `BOS_ID`. Returns int32 [N (+1)]."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
    return np.concatenate([np.array([BOS_ID], np.int32), ids]) if bos else ids


def decode(ids) -> str:
    """Text of token ids: byte runs decoded as UTF-8 (invalid bytes replaced), specials by name.

    ids: [N] integers in [0, VOCAB_SIZE).
    """
    ids = np.asarray(ids).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
        raise ValueError(
            f"decode: ids must lie in [0, {VOCAB_SIZE}), got values in "
            f"[{ids.min()}, {ids.max()}]; pass token ids from this byte-level vocabulary"
        )
    pieces, run = [], bytearray()
    for token in ids.tolist():
        if token < NUM_BYTES:
            run.append(token)
            continue
        pieces.append(run.decode("utf-8", errors="replace"))
        run = bytearray()
        pieces.append(_SPECIAL_NAMES.get(token, f"<unused{token}>"))
    pieces.append(run.decode("utf-8", errors="replace"))
    return "".join(pieces)
