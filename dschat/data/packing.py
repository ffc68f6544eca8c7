"""Padding-free training batches: ``--packing`` and ``--group-by-length``.

``--packing`` lays several training rows end to end in one sequence. Each row keeps its own position ids
(0, 1, ... restarting at every row) and a block-diagonal causal attention mask, so no token ever attends to
another row: the per-token logits, and hence every loss, are those of the rows trained one by one. The rows are
put into sequences once, before training, by best-fit decreasing (``pack``): each sequence holds up to
``capacity`` tokens, the length that leaves the fewest padded tokens (``best_capacity``) and at most
``--max-seq-len`` (a pair stage packs whole pairs, chosen and rejected side by side, up to twice that), so a batch
of ``--per-device-train-batch-size`` sequences is nearly all real tokens, where padding every row to the longest
of its batch wastes the difference. The sequences are shuffled each epoch like rows.

Stage 1 trains on the packed labels directly (the first label of every row is masked: it would be predicted
from the previous row's last token). The pair stages (reward model, DPO) get both views from one collator: the
packed sequences the model runs on, and the usual ``(2B, T)`` right-padded view their losses read, with
``packed_index`` mapping each position of that view to its packed position (``unpack``). So the losses are
unchanged code, and chosen/rejected stay distinguishable.

``--group-by-length`` is the cheap alternative: rows stay one per sequence, but each batch takes rows of similar
length (``LengthGroupedSampler``), so little padding is left; batches differ from the default shuffle's.

Attention: the collators describe rows by ``segment_ids``; ``block_causal_mask`` turns those into the 4-D mask
the model's attention implementation takes (boolean for sdpa, additive for eager). Flash-attention
implementations take none: they find the rows from the restarting position ids (varlen).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from dschat.errors import UserError
from dschat.utils import unwrap


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: the indices of ``lengths`` grouped into bins of total length <= ``capacity``.

    Longest first, each into the fullest bin it still fits (a new bin when none); ties go to the lower index, so
    the result depends on the lengths alone. A unit longer than ``capacity`` gets a bin of its own.
    """
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        j = bisect.bisect_left(free, (n, -1))  # the bin with the least room that still fits n
        if j < len(free):
            room, b = free.pop(j)
        else:
            room, b = max(capacity, n), len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(free, (room - n, b))
    return bins


def best_capacity(lengths: Sequence[int], limit: int, sample: int = 4096) -> int:
    """The sequence length, at most ``limit``, that packs ``lengths`` into the fewest padded tokens (sequences x
    length). Rows of similar length fill ``limit`` badly and a length of their own well: the benchmark's SFT rows
    (70-121 tokens) fill 87% of 249-token sequences, two to a sequence, and 96% of 217-token ones. Searched on an
    evenly spaced sample of at most ``sample`` lengths, over at most 65 lengths from the longest row (or
    ``limit``) up to ``limit``; a tie keeps the longer length. Depends on the lengths alone, so every rank agrees."""
    low = min(max(lengths, default=limit), limit)
    if low >= limit:
        return limit
    probe = list(lengths[:: -(-len(lengths) // sample)])  # every k-th length: at most ``sample`` of them
    stride = -(-(limit - low) // 64)
    return min([*range(low, limit, stride), limit], key=lambda c: (len(pack(probe, c)) * c, -c))


def pack_rows(rows: Sequence[dict[str, Any]], capacity: int,
              length: Callable[[dict[str, Any]], int]) -> list[dict[str, Any]]:
    """The rows in packs ``{"pack": [row, ...]}`` of at most ``capacity`` tokens (``length(row)`` each)."""
    return [{"pack": [rows[i] for i in b]} for b in pack([length(r) for r in rows], capacity)]


def block_causal_mask(segment_ids: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The attention mask ``(S, 1, W, W)`` of packed sequences ``(S, W)``: token q sees token k when k <= q and
    both belong to the same row (``segment_ids`` equal). Boolean (True: attend) for sdpa, additive (0 or the
    dtype's minimum) for eager; None for flash attention, which reads the rows from the position ids."""
    if not takes_4d_mask(implementation):
        return None
    width = segment_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segment_ids.device).tril()
    return mask_4d((segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)) & causal, implementation, dtype)


def takes_4d_mask(implementation: str) -> bool:
    """Whether an attention implementation takes an arbitrary ``(S, 1, W, W)`` mask (sdpa, eager) or finds rows
    from the position ids (flash, flex)."""
    return not (implementation.startswith("flash") or implementation == "flex_attention")


def mask_4d(allowed: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` ``(S, W, W)`` (query, key) as the model's 4-D mask: boolean for sdpa, additive for eager."""
    allowed = allowed.unsqueeze(1)
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def attention_of(model: Any) -> tuple[str, torch.dtype]:
    """The attention implementation of ``model`` (a module or an engine) and its parameters' dtype."""
    module = unwrap(model)
    return getattr(module.config, "_attn_implementation", None) or "sdpa", next(module.parameters()).dtype


def packed_inputs(model: Any, batch: dict[str, torch.Tensor], prefix: str = "") -> dict[str, Any]:
    """``input_ids``, ``position_ids`` and ``attention_mask`` for ``model`` (its config's attention
    implementation) from a packed batch's ``{prefix}input_ids/position_ids/segment_ids``."""
    implementation, dtype = attention_of(model)
    return {"input_ids": batch[f"{prefix}input_ids"], "position_ids": batch[f"{prefix}position_ids"],
            "attention_mask": block_causal_mask(batch[f"{prefix}segment_ids"], implementation, dtype)}


def prompt_ids(prompt: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """``(B,)``: one id per distinct prompt (tokens and padding alike), 0 to n - 1 over the n distinct prompts, the
    same for every row that repeats one wherever it sits (a GRPO group's completions, shuffled or not)."""
    key = torch.cat([prompt, prompt_mask.to(prompt.dtype)], dim=1)
    return torch.unique(key, dim=0, return_inverse=True)[1]


def attention_balance(model: Any) -> float:
    """The sequence length at which a token's attention (one query over that many keys, dense) costs as many
    forward FLOPs as its trip through a layer's linear maps, from ``model``'s config: ``(q, k, v, o and the
    gated MLP's three maps) / (4 * heads * head_dim)``. About 1,570 for the bench's 4-layer 256-wide Llama, 24,700
    for Llama-2-7B. Without those config fields, 8x the hidden size. A heuristic for choosing a layout: it
    counts a gated three-map MLP (a two-map MLP, as GPT-NeoX's, has about 2/3 of that) and one expert's width for
    mixture-of-experts models (their tokens pass top-k experts)."""
    config = getattr(unwrap(model), "config", None)
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    inter = getattr(config, "intermediate_size", None)
    if not (isinstance(hidden, int) and isinstance(heads, int) and isinstance(inter, int)) or heads <= 0:
        return 8.0 * (hidden if isinstance(hidden, int) else 1024)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    linear = 2 * hidden * (heads + 2 * kv) * head_dim + 2 * heads * head_dim * hidden + 2 * 3 * hidden * inter
    return linear / (4 * heads * head_dim)


def shared_prompt_groups(rows_of: Sequence[Sequence[int]], prompt_len: Sequence[int], answer_len: Sequence[int],
                         balance: float, unshared_width: int, area_cap: float = 2.0,
                         max_width: int | None = None) -> list[list[int]] | None:
    """Rows that share a prompt grouped into sequences of one prompt and some of its rows' answers (the layout of
    ``rollout.shared_prompt_inputs``), every sequence padded to the longest, W: the grouping with the fewest
    forward FLOPs for the padded batch, ``n * (W + W**2 / balance)`` (n sequences, each token through the linear
    maps plus dense masked attention over W keys, ``attention_balance``), among the greedy fills of each width W
    that every row fits in (a prompt's rows in order, a new sequence when the next answer would pass W), none wider
    than ``max_width`` (a sliding window). None when no grouping shares a sequence or the rows as they are
    (``unshared_width`` = prompt + answer budget, one row per sequence) cost no more. The masks' area ``n * W**2``
    stays within ``area_cap`` times the rows' (eager attention holds it per head).

    Args:
        rows_of: per distinct prompt, its rows (indices into ``prompt_len``/``answer_len``).
    """
    rows_of = [r for r in rows_of if r]
    B = sum(len(r) for r in rows_of)
    if B < 2 or all(len(r) < 2 for r in rows_of):
        return None

    def cost(n: int, width: int) -> float:
        return n * (width + width * width / balance)

    fits = max(prompt_len[r[0]] + max(answer_len[i] for i in r) for r in rows_of)
    widths = {fits}
    for rows in rows_of:
        total = prompt_len[rows[0]]
        for i in rows:
            total += answer_len[i]
            if total > fits:
                widths.add(total)
    best: tuple[float, int, list[list[int]]] | None = None
    for width in sorted(w for w in widths if max_width is None or w <= max_width):
        groups: list[list[int]] = []
        for rows in rows_of:
            p, current, used = prompt_len[rows[0]], None, 0
            for i in rows:
                if current is None or used + answer_len[i] > width:  # each prompt opens its own sequences
                    current, used = [], p
                    groups.append(current)
                current.append(i)
                used += answer_len[i]
        n = len(groups)
        if n == B or n * width * width > area_cap * B * unshared_width * unshared_width:
            continue  # nothing shared (the rows as they are, costed below), or too large a mask
        c = cost(n, width)
        if best is None or c < best[0]:
            best = (c, width, groups)
    if best is None or best[0] >= cost(B, unshared_width):
        return None
    return best[2]


def common_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B,)``: how many first tokens rows ``i`` and ``B + i`` of a right-padded ``(2B, L)`` pair batch share,
    at most each row's length minus one (every row keeps a last token of its own)."""
    B = input_ids.shape[0] // 2
    same = (input_ids[:B] == input_ids[B:]).long().cumprod(-1).sum(-1)
    real = attention_mask.sum(-1)
    return torch.minimum(same, torch.minimum(real[:B], real[B:]) - 1).clamp(min=0)


def shared_prefix_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         shared: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """One sequence per pair for a right-padded ``(2B, L)`` pair batch (B chosen rows, then their B rejected
    rows) whose rows ``i`` and ``B + i`` begin with the same ``shared[i]`` tokens (the prompt): those tokens once,
    then the rest of the chosen row, then the rest of the rejected row at the positions it has in its own row.
    With ``shared_prefix_mask`` each token sees exactly what it sees in its own row, so per-token outputs are
    those of the two rows, for one copy of the prefix and the padding of one sequence instead of two.

    Returns ``input_ids``, ``position_ids`` and ``part`` (0 shared, 1 chosen, 2 rejected, -1 padding), all
    ``(B, W)``, and ``index`` ``(2B, L)``: each view position's flat position in the layout (0 at padding), for
    ``unpack``. None when a pair's rows differ within ``shared``."""
    n, L = input_ids.shape
    B, device = n // 2, input_ids.device
    real = attention_mask.sum(-1)
    if bool((shared > torch.minimum(real[:B], real[B:])).any()):
        return None
    within = torch.arange(L, device=device).unsqueeze(0) < shared.unsqueeze(1)
    chosen, rejected = input_ids[:B], input_ids[B:]
    if not torch.equal(chosen[within], rejected[within]):
        return None
    lc, lx, ps = real[:B].tolist(), real[B:].tolist(), shared.tolist()
    W = max(a + b - q for a, b, q in zip(lc, lx, ps, strict=True))
    ids = torch.zeros(B, W, dtype=input_ids.dtype, device=device)
    pos = torch.zeros(B, W, dtype=torch.long, device=device)
    part = torch.full((B, W), -1, dtype=torch.long, device=device)
    index = torch.zeros(n, L, dtype=torch.long, device=device)
    for i, (a, b, q) in enumerate(zip(lc, lx, ps, strict=True)):
        tail = b - q  # the rejected row after the prefix, placed after the chosen row
        ids[i, :a], ids[i, a: a + tail] = chosen[i, :a], rejected[i, q:b]
        pos[i, :a] = torch.arange(a, device=device)
        pos[i, a: a + tail] = torch.arange(q, b, device=device)
        part[i, :q], part[i, q:a], part[i, a: a + tail] = 0, 1, 2
        index[i, :a] = i * W + torch.arange(a, device=device)
        index[B + i, :q] = i * W + torch.arange(q, device=device)
        index[B + i, q:b] = i * W + a + torch.arange(tail, device=device)
    return {"input_ids": ids, "position_ids": pos, "part": part, "index": index}


def shared_prefix_mask(part: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask of ``shared_prefix_layout``: causal, and a query sees the shared prefix and its own row's
    part (``part`` 0, or equal to its own); every query also sees itself, so no row of the softmax is empty."""
    W = part.shape[1]
    causal = torch.ones(W, W, dtype=torch.bool, device=part.device).tril()
    itself = torch.eye(W, dtype=torch.bool, device=part.device)
    key, query = part.unsqueeze(1), part.unsqueeze(2)
    return mask_4d((causal & ((key == 0) | ((key == query) & (key > 0)))) | itself, implementation, dtype)


def shared_prefix_inputs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         shared: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
    """``model``'s inputs for the ``shared_prefix_layout`` of a pair batch, and its ``index``; None where that
    layout does not apply (``layout_attention``), does not pay, or a pair's rows differ within ``shared``."""
    real = attention_mask.sum(-1).double()
    B = len(shared)
    width = real[:B] + real[B:] - shared.double()
    attention = layout_attention(model, int(width.max()))
    # Attention over one long sequence per pair costs W^2 where the rows cost a^2 + b^2: worth it while the
    # prefix is a fair share of the rows (the fewer tokens through the layers pay for it), not for a short prompt
    # before long answers, where attention would do up to twice the rows' work.
    if attention is None or float((width**2).sum()) > 1.25 * float((real**2).sum()):
        return None
    lay = shared_prefix_layout(input_ids, attention_mask, shared)
    if lay is None:
        return None
    return {"input_ids": lay["input_ids"], "position_ids": lay["position_ids"],
            "attention_mask": shared_prefix_mask(lay["part"], *attention)}, lay["index"]


def layout_attention(model: Any, width: int) -> tuple[str, torch.dtype] | None:
    """The attention implementation and dtype to build a shared-prefix layout's mask with (``shared_prefix_mask``)
    for sequences of up to ``width`` tokens, or None where such a layout does not apply: attention that takes no
    4-D mask (flash, flex), ALiBi positions (``positions_from_ids``), or a sliding window shorter than ``width``."""
    implementation, dtype = attention_of(model)
    if not takes_4d_mask(implementation) or not positions_from_ids(model):
        return None
    window = layout_window(model)
    if window is not None and width > window:
        return None
    return implementation, dtype


def layout_window(model: Any) -> int | None:
    """The longest sequence a shared-prefix layout may hold for ``model``: its config's sliding window, or None
    (no limit)."""
    window = getattr(getattr(unwrap(model), "config", None), "sliding_window", None)
    return window or None


ALIBI_MODEL_TYPES = ("bloom", "mpt")


def positions_from_ids(model: Any) -> bool:
    """Whether ``model`` places tokens by its ``position_ids`` (rotary or learned positions), which packed and
    shared-prefix layouts set per row. ALiBi models (Bloom, MPT, Falcon with ``alibi``) derive the positions
    from a 2-D attention mask instead, which those layouts do not have."""
    module = unwrap(model)
    config = getattr(module, "config", None)
    if config is None:
        return False
    return not (getattr(config, "alibi", False) or getattr(config, "model_type", "") in ALIBI_MODEL_TYPES)


def check_packing(model: Any, max_seq_len: int) -> None:
    """Stop when ``model`` has sliding-window attention shorter than a row may be: one 4-D mask serves every layer
    of a packed batch, so its sliding layers would see past their window (flash attention, which takes no mask,
    keeps them; the check does not look at that), and for ALiBi models (``positions_from_ids``)."""
    module = unwrap(model)
    config = getattr(module, "config", None)
    if not positions_from_ids(model):
        raise UserError(f"--packing: {getattr(config, 'model_type', 'this model')} derives token positions from a "
                        "2-D attention mask (ALiBi), which packed sequences do not have; train without --packing "
                        "(--group-by-length batches rows of similar length instead)")
    window = getattr(config, "sliding_window", None)
    if not window or window >= max_seq_len or getattr(config, "use_sliding_window", True) is False:
        return
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ["sliding_attention"]):
        return
    raise UserError(f"--packing: the model attends within a sliding window of {window} tokens, shorter than "
                    f"--max-seq-len {max_seq_len}; lower --max-seq-len to {window} or train without --packing")


def sft_inputs(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The causal LM's inputs (labels included) of an SFT batch, packed or not."""
    if "segment_ids" in batch:
        return {**packed_inputs(model, batch), "labels": batch["labels"]}
    return {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The batch's tokens that are not padding."""
    return int(batch["num_tokens"]) if "num_tokens" in batch else int(batch["attention_mask"].sum())


class _Layout:
    """Where each token of each row goes in the packed ``(S, W)`` tensors."""

    def __init__(self, seqs_per_pack: list[list[list[int]]], pad_token_id: int):
        self.width = max(sum(len(s) for s in seqs) for seqs in seqs_per_pack)
        n = len(seqs_per_pack)
        self.input_ids = torch.full((n, self.width), pad_token_id, dtype=torch.long)
        self.position_ids = torch.zeros((n, self.width), dtype=torch.long)
        self.segment_ids = torch.zeros((n, self.width), dtype=torch.long)
        self.starts: list[list[int]] = []  # per pack, where each of its sequences starts
        for s, seqs in enumerate(seqs_per_pack):
            at, starts = 0, []
            for j, seq in enumerate(seqs):
                starts.append(at)
                self.input_ids[s, at: at + len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
                self.position_ids[s, at: at + len(seq)] = torch.arange(len(seq))
                self.segment_ids[s, at: at + len(seq)] = j
                at += len(seq)
            # The padding tail is a segment of its own, positions from 0: no row attends to it (it comes after
            # them) and it attends only to itself, so no query row of the mask is empty.
            self.position_ids[s, at:] = torch.arange(self.width - at)
            self.segment_ids[s, at:] = len(seqs)
            self.starts.append(starts)
        self.real = sum(len(s) for seqs in seqs_per_pack for s in seqs)


class PackedSFTCollator:
    """Packs of SFT rows -> ``input_ids``, ``labels``, ``position_ids``, ``segment_ids`` ``(S, W)`` and
    ``num_tokens`` (the real tokens). Each row's first label is -100: the token before it is another row's."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, packs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        lay = _Layout([[r["input_ids"] for r in p["pack"]] for p in packs], self.pad_token_id)
        labels = torch.full_like(lay.input_ids, -100)
        for s, p in enumerate(packs):
            for at, r in zip(lay.starts[s], p["pack"], strict=True):
                labels[s, at + 1: at + len(r["labels"])] = torch.as_tensor(r["labels"][1:], dtype=torch.long)
        return {"input_ids": lay.input_ids, "labels": labels, "position_ids": lay.position_ids,
                "segment_ids": lay.segment_ids, "num_tokens": torch.tensor(lay.real)}


class PackedPairsCollator:
    """Packs of pairs -> ``base``'s usual ``(2B, T)`` batch of their rows (B chosen, then B rejected: what the
    losses read) plus the packed sequences the model runs on: ``packed_input_ids``, ``packed_position_ids``,
    ``packed_segment_ids`` ``(S, W)``; ``packed_row`` ``(S, W)``, the row of the ``(2B, T)`` view each packed
    token belongs to (-1: padding); ``packed_index`` ``(2B, T)``, the flat packed position of each position of
    the view (0 on its padding, which the losses mask); and ``packs``, the packs themselves."""

    def __init__(self, base: Any):
        self.base = base

    def __call__(self, packs: list[dict[str, Any]]) -> dict[str, Any]:
        rows = [r for p in packs for r in p["pack"]]
        batch = self.base(rows)
        b, width_view = len(rows), batch["input_ids"].shape[1]
        lay = _Layout([[s for r in p["pack"] for s in (r["chosen_input_ids"], r["rejected_input_ids"])]
                       for p in packs], self.base.pad_token_id)
        row_of = torch.full_like(lay.input_ids, -1)
        index = torch.zeros((2 * b, width_view), dtype=torch.long)
        k = 0
        for s, p in enumerate(packs):
            for j, r in enumerate(p["pack"]):
                for u, seq, at in ((k, r["chosen_input_ids"], lay.starts[s][2 * j]),
                                   (b + k, r["rejected_input_ids"], lay.starts[s][2 * j + 1])):
                    row_of[s, at: at + len(seq)] = u
                    index[u, : len(seq)] = s * lay.width + at + torch.arange(len(seq))
                k += 1
        batch.update({"packed_input_ids": lay.input_ids, "packed_position_ids": lay.position_ids,
                      "packed_segment_ids": lay.segment_ids, "packed_row": row_of, "packed_index": index,
                      "packs": packs})
        return batch


def unpack(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-token values of packed sequences ``(S, W)`` -> the ``(2B, T)`` right-padded view (``packed_index``)."""
    return packed.reshape(-1)[index]


def unpacked_rows(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of a training set, packed (``pack_rows``) or not, in order."""
    return [r for it in items for r in it["pack"]] if items and "pack" in items[0] else list(items)


class LengthGroupedSampler(Sampler[int]):
    """``--group-by-length``: a sampler (like ``DistributedSampler``: ``set_epoch``, this rank's share) whose
    consecutive runs of ``batch_size`` indices are rows of similar length.

    Each epoch: a seeded shuffle, cut into mega-batches of 50 global batches (``batch_size`` x ranks rows), each
    sorted by length, longest first, and cut into global batches; their order is shuffled (a partial last one
    stays last), and rank r takes rows r, r + ranks, ... of each. With several ranks the rows are first cut to a
    multiple of the rank count, as ``DistributedSampler(drop_last=True)`` does.
    """

    MEGA = 50

    def __init__(self, lengths: Sequence[int], batch_size: int, num_replicas: int, rank: int, seed: int):
        self.lengths, self.batch_size, self.world, self.rank, self.seed = list(lengths), batch_size, num_replicas, \
            rank, seed
        self.epoch = 0
        n = len(self.lengths)
        self.total = n - n % num_replicas if num_replicas > 1 else n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        """The global batches of this epoch, in order."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()[: self.total]
        size = self.batch_size * self.world
        out: list[list[int]] = []
        for m in range(0, len(order), size * self.MEGA):
            chunk = sorted(order[m: m + size * self.MEGA], key=lambda i: -self.lengths[i])
            out += [chunk[i: i + size] for i in range(0, len(chunk), size)]
        last = [out.pop()] if out and len(out[-1]) < size else []
        return [out[i] for i in torch.randperm(len(out), generator=g).tolist()] + last

    def __iter__(self) -> Iterator[int]:
        return iter([i for b in self.batches() for i in b[self.rank:: self.world]])

    def __len__(self) -> int:
        return self.total // self.world


def sft_length(row: dict[str, Any]) -> int:
    return len(row["input_ids"])


def pair_length(row: dict[str, Any]) -> int:
    """A pair's packed length: chosen and rejected side by side."""
    return len(row["chosen_input_ids"]) + len(row["rejected_input_ids"])


def pair_width(row: dict[str, Any]) -> int:
    """A pair's padded width in a ``(2B, T)`` batch (what length grouping compares)."""
    return max(len(row["chosen_input_ids"]), len(row["rejected_input_ids"]))


__all__ = ["LengthGroupedSampler", "PackedPairsCollator", "PackedSFTCollator", "best_capacity", "block_causal_mask",
           "check_packing", "pack", "pack_rows", "packed_inputs", "pair_length", "pair_width", "prompt_ids",
           "real_tokens", "sft_inputs", "sft_length", "unpack", "unpacked_rows"]
