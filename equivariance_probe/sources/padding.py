"""Padded token batches: strip the padding a tokenizer added, refuse padding we cannot see.

Place in the seams: *sources*, in front of the probe's windowing. The probe measures attention by
*absolute* position, so a window must start at its first real token: a left-padded row
(``[pad, pad, t0, t1, ...]``, what ``tokenizer(texts, padding=True)`` gives with
``padding_side="left"``) would put ``t0`` at position 2 and let real queries attend to pad
keys. The probe therefore

* accepts the tokenizer's output itself (a ``BatchEncoding`` or any mapping with
  ``input_ids`` and ``attention_mask``): each row keeps exactly the tokens its
  ``attention_mask`` marks, left or right padding alike (:func:`rows_from_encoding`);
* refuses a bare token tensor whose rows start with the tokenizer's pad token (when that id is
  distinct from its BOS and EOS ids, so a real text cannot start with it), naming the fix
  (:func:`check_not_left_padded`). Where the pad id equals BOS or EOS (GPT-2) padding cannot
  be told from text: such tensors are used as given, and docs/getting-started.md says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import InputError

__all__ = ["rows_from_encoding", "check_not_left_padded"]


def rows_from_encoding(encoding: Mapping[str, Any]) -> list[torch.Tensor]:
    """The real tokens of each row of ``{"input_ids": [n, T], "attention_mask": [n, T]}``.

    Returns:
        one ``LongTensor [length_i]`` per row, padding removed.

    Raises:
        InputError: no ``input_ids``; a mask of another shape; a row whose real tokens are
            not contiguous (padding in the middle).
    """
    if "input_ids" not in encoding:
        raise InputError(
            f"a mapping of documents needs 'input_ids' (got keys {sorted(encoding)}); pass the tokenizer's output, "
            "a list of strings, or a LongTensor [n_docs, n_tokens]"
        )
    ids = torch.as_tensor(encoding["input_ids"])
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    mask = encoding.get("attention_mask")
    if mask is None:
        return list(ids)
    mask = torch.as_tensor(mask)
    if mask.numel() != ids.numel():
        raise InputError(f"attention_mask of shape {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    mask = mask.reshape(ids.shape)
    rows = []
    for index, (row, keep) in enumerate(zip(ids, mask.bool())):
        where = keep.nonzero().flatten()
        if where.numel() and int(where[-1] - where[0]) + 1 != where.numel():
            raise InputError(
                f"row {index} of the batch has padding between real tokens (attention_mask {keep.int().tolist()}); "
                "only left or right padding can be removed: tokenise each document on its own"
            )
        rows.append(row[keep])
    return rows


def check_not_left_padded(tokens: torch.Tensor, tokenizer: Any | None) -> None:
    """Refuse ``tokens: [n, T]`` whose rows start with the tokenizer's (distinct) pad id.

    Raises:
        InputError: naming the rows, the pad id and the fix.
    """
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None or tokens.numel() == 0:
        return
    if pad in {getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)}:
        return  # pad = BOS/EOS (GPT-2 style): padding cannot be told from text
    padded = (tokens[:, 0] == pad).nonzero().flatten().tolist()
    if padded:
        raise InputError(
            f"rows {padded[:5]} start with the pad token (id {pad}): the batch looks left-padded, which would shift "
            "every absolute position. Pass the tokenizer's output with its mask, probe.run(tokenizer(texts, "
            "padding=True, return_tensors='pt')), so padding is removed; or pass the list of strings"
        )
