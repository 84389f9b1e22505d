"""``gpusolver.packing``: a packed sequence to shards, labels, positions, masks, the target count and the loss."""
import pytest
import torch

import gpusolver
from gpusolver.masks import slices_to_dense, varlen_causal_mask
from gpusolver.packing import (IGNORE_INDEX, count_targets, document_mask, document_positions, pack, shard_loss,
                               shift_labels, windowed)
from gpusolver.runtime import unshard
from groupcomm import LocalGroup, TorchGroup
from tests._dist import run_ranks
from tests._testing import assert_close

X = IGNORE_INDEX


def _dense_documents(lengths, window=None):
    """[S, S] bool: causal inside each document, the last ``window`` keys if given."""
    S = sum(lengths)
    out = torch.zeros(S, S, dtype=torch.bool)
    start = 0
    for n in lengths:
        i = torch.arange(n)
        keep = i[None, :] <= i[:, None]
        if window is not None:
            keep &= i[None, :] > i[:, None] - window
        out[start:start + n, start:start + n] = keep
        start += n
    return out


def test_labels_positions_and_shards_by_hand():
    tokens = torch.arange(10, 18)
    b = pack(tokens, [3, 5], group=LocalGroup(2))
    assert b.input_ids.tolist() == [[10, 11, 12, 13], [14, 15, 16, 17]]
    # shifted on the whole sequence: the pair (13 -> 14) crosses the shard boundary and is kept
    assert b.labels.tolist() == [[11, 12, X, 14], [15, 16, 17, X]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0], [1, 2, 3, 4]]
    assert int(b.num_targets) == 6
    g = pack(tokens, [3, 5], group=LocalGroup(2), positions="global")
    assert g.position_ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert torch.equal(slices_to_dense(b.mask), _dense_documents([3, 5]))


def test_cu_seqlens_and_tensor_lengths_agree():
    tokens = torch.randint(0, 50, (24,))
    a = pack(tokens, [5, 11, 8], group=LocalGroup(4))
    for kw in (dict(cu_seqlens=torch.tensor([0, 5, 16, 24])), dict(doc_lengths=torch.tensor([5, 11, 8]))):
        b = pack(tokens, group=LocalGroup(4), **kw)
        for name in ("input_ids", "labels", "position_ids", "num_targets"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_padding_document_and_given_labels():
    tokens = torch.arange(30)
    labels = tokens.clone()
    labels[:4] = X  # a prompt: no targets there
    b = pack(tokens, [5, 9, 16], group=LocalGroup(4), labels=labels, pad_token_id=7)
    assert b.doc_lengths == [5, 9, 16, 2]
    whole = unshard(b.labels, LocalGroup(4))
    assert whole[-3:].tolist() == [X, X, X]             # the last document's end, then the padding
    assert whole[:5].tolist() == [X, X, X, 4, X]        # targets 1..3 are prompt tokens
    assert unshard(b.input_ids, LocalGroup(4))[-2:].tolist() == [7, 7]
    assert int(b.num_targets) == int((whole != X).sum()) == 32 - 3 - 3 - 2  # prompt targets, document ends, padding
    # the padding is a document of its own: it attends itself, never the others
    assert torch.equal(slices_to_dense(b.mask), _dense_documents([5, 9, 16, 2]))


@pytest.mark.parametrize("window", [1, 3, 5, 40])
def test_window_masks_equal_the_dense_definition(window):
    lengths = [5, 9, 2, 16]
    m = document_mask(lengths, sliding_window=window, max_documents=6)
    assert m.num_slices == 12  # two rows per document, fixed by max_documents
    m.validate(cp_size=4)
    assert torch.equal(slices_to_dense(m), _dense_documents(lengths, window))


def test_window_of_a_grouped_mask_and_on_meta():
    base = varlen_causal_mask([6, 10])
    grouped = gpusolver.AttnSlices(base.q_ranges.expand(2, -1, -1).clone(), base.k_ranges.expand(2, -1, -1).clone(),
                                   base.attn_type.expand(2, -1).clone(), 16, 16)
    w = windowed(grouped, 3)
    assert w.q_ranges.shape == (2, 4, 2)
    for g in range(2):
        assert torch.equal(slices_to_dense(w, g), _dense_documents([6, 10], 3))
    meta = gpusolver.AttnSlices(base.q_ranges.to("meta"), base.k_ranges.to("meta"), base.attn_type.to("meta"), 16, 16)
    assert windowed(meta, 3).q_ranges.shape == (4, 2)  # no host read on the way


def test_window_refuses_other_rows_in_both_modes():
    mask = gpusolver.AttnSlices(torch.tensor([[0, 8], [8, 16]], dtype=torch.int32),
                                torch.tensor([[0, 8], [0, 16]], dtype=torch.int32),
                                torch.tensor([1, 0], dtype=torch.int32), 16, 16)
    with pytest.raises(ValueError, match=r"row 1: .* got q \[8, 16\), k \[0, 16\), type 0"):
        windowed(mask, 4)
    gpusolver.check_errors()  # nothing pending before
    windowed(mask, 4, validate=False)
    with pytest.raises(ValueError, match=r"windowed: mask row 1: .*type 0: .*\[device error flag"):
        gpusolver.check_errors()


def test_shard_loss_matches_the_single_process_loss():
    group = LocalGroup(4)
    tokens = torch.randint(0, 11, (32,))
    b = pack(tokens, [7, 13, 12], group=group)
    logits = torch.randn(32, 11, dtype=torch.float64)
    whole = unshard(b.labels, group)
    want = torch.nn.functional.cross_entropy(logits, whole, ignore_index=X)  # the mean over valid targets
    per_rank = [shard_loss(part, lab, b.num_targets) for part, lab in zip(logits.view(4, 8, 11), b.labels)]
    assert_close("sum of shard losses", want, sum(per_rank).double(), atol=1e-6, rtol=0)
    assert_close("stacked shards", want, shard_loss(logits.view(4, 8, 11), b.labels, b.num_targets).double(),
                 atol=1e-6, rtol=0)
    none = torch.full((8,), X)
    assert shard_loss(logits[:8], none, torch.tensor(0)).item() == 0.0  # no target anywhere: 0, not NaN
    assert int(count_targets(b.labels, group)) == int(b.num_targets)


def _count_on_rank(rank, P):
    tokens = torch.arange(24)
    b = pack(tokens, [5, 11, 8], group=TorchGroup())
    return int(count_targets(b.labels, TorchGroup())), int(b.num_targets), b.input_ids.tolist()


def test_count_targets_all_reduces_over_gloo():
    results = run_ranks(_count_on_rank, 2, timeout=60)
    assert [r[:2] for r in results] == [(21, 21), (21, 21)]
    assert results[0][2] == list(range(12)) and results[1][2] == list(range(12, 24))


def test_document_positions_and_shift_alone():
    assert document_positions([2, 3]).tolist() == [0, 1, 0, 1, 2]
    assert shift_labels(torch.tensor([5, 6, 7, 8, 9]), [2, 3]).tolist() == [6, X, 8, 9, X]


@pytest.mark.parametrize("kwargs, match", [
    (dict(doc_lengths=[4, 4], cu_seqlens=[0, 4, 8]), "exactly one of doc_lengths= and cu_seqlens="),
    (dict(doc_lengths=[4, 3]), "the documents hold 7 tokens but tokens has S = 8"),
    (dict(doc_lengths=[4, 0, 4]), r"doc_lengths\[1\] = 0 must be a positive int"),
    (dict(cu_seqlens=[0, 4, 4, 8]), "cu_seqlens must increase strictly: offsets 1 and 2 are 4 and 4"),
    (dict(cu_seqlens=[1, 8]), "cu_seqlens must start at 0"),
    (dict(doc_lengths=[8], pad_to_multiple=3), "pad_to_multiple must be a positive multiple of P = 2, got 3"),
    (dict(doc_lengths=[8], positions="rope"), "positions must be one of"),
    (dict(doc_lengths=[8], labels=torch.zeros(7)), "labels must be a tensor of tokens' shape"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack(torch.arange(8), group=LocalGroup(2), **kwargs)


def test_bad_tokens_window_and_logits():
    with pytest.raises(ValueError, match="tokens must be a 1-D integer tensor"):
        pack(torch.zeros(2, 4, dtype=torch.long), [8], group=LocalGroup(2))
    with pytest.raises(ValueError, match="window must be a positive int"):
        windowed(varlen_causal_mask([4]), 0)
    with pytest.raises(ValueError, match=r"logits \(4, 3\) must be labels' shape \(5,\) plus the vocab"):
        shard_loss(torch.zeros(4, 3), torch.zeros(5, dtype=torch.long), 1)
