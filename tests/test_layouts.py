"""Block-sparse layouts: classification, partial blocks only, constructors, bad input."""

import pytest
import torch

import attnperf
from attnperf import layouts
from attnperf.layouts import EMPTY, FULL, PARTIAL, BlockMask


def dense(mask_fn, B, H, L, S):
    b = torch.arange(B).view(-1, 1, 1, 1)
    h = torch.arange(H).view(1, -1, 1, 1)
    q = torch.arange(L).view(1, 1, -1, 1)
    k = torch.arange(S).view(1, 1, 1, -1)
    return mask_fn(b, h, q, k).expand(B, H, L, S)


PATTERNS = {
    "causal": layouts.causal(),
    "causal_bottom_right": layouts.causal(align_offset=7),
    "sliding": layouts.sliding_window(20),
    "document": layouts.document(torch.tensor([0, 30, 31, 90, 100]), is_causal=False),
    "prefix_lm": layouts.prefix_lm(33),
    "per_head": lambda b, h, q, k: (k + h * 17) % 50 < 30,
}


@pytest.mark.parametrize("block_size", [16, (32, 64), 128], ids=str)
@pytest.mark.parametrize("name", PATTERNS)
def test_layout_stands_for_its_mask_fn(name, block_size):
    fn = PATTERNS[name]
    heads = 3 if name == "per_head" else None
    layout = attnperf.block_mask(fn, None, heads, 100, 93, block_size=block_size)
    expected = dense(fn, 1, heads or 1, 100, 93)
    assert torch.equal(layout.to_dense(), expected)
    # Each block is classified by what it holds.
    for b, h, qb, kb in torch.cartesian_prod(*(torch.arange(n) for n in layout.kinds.shape)):
        block_q, block_k = layout.block_size
        tile = expected[b, h, qb * block_q : (qb + 1) * block_q, kb * block_k : (kb + 1) * block_k]
        kind = int(layout.kinds[b, h, qb, kb])
        assert kind == (FULL if tile.all() else EMPTY if not tile.any() else PARTIAL)
        assert (int(layout.partial_index[b, h, qb, kb]) >= 0) == (kind == PARTIAL)


def test_only_partial_blocks_keep_element_masks():
    """Causal at 4096 x 4096 in 128-blocks: only the 32 diagonal blocks are partial, so the
    layout holds 32 x 128 x 128 bits, O(L x block), not L x S."""
    layout = attnperf.block_mask(layouts.causal(), None, None, 4096, 4096, block_size=128)
    assert layout.partial.shape == (32, 128, 128)
    assert int((layout.kinds == EMPTY).sum()) == 32 * 31 // 2
    assert layout.sparsity() == pytest.approx(31 / 64)


def test_from_dense_round_trips_and_fits_a_call():
    mask = torch.rand(2, 3, 40, 50) > 0.6
    mask[..., :16, :16] = True  # a full block
    mask[..., 16:32, 16:32] = False  # an empty one
    layout = BlockMask.from_dense(mask, block_size=16)
    assert layout.shape == (2, 3, 40, 50)
    assert torch.equal(layout.to_dense(), mask)
    assert int(layout.kinds[0, 0, 0, 0]) == FULL and int(layout.kinds[0, 0, 1, 1]) == EMPTY
    q, k, v = torch.randn(2, 3, 40, 8), torch.randn(2, 3, 50, 8), torch.randn(2, 3, 50, 8)
    torch.testing.assert_close(
        attnperf.attention(q, k, v, block_mask=layout, backend="reference"),
        attnperf.attention(q, k, v, attn_mask=mask, backend="reference"),
    )


def test_mask_fn_is_evaluated_a_row_of_blocks_at_a_time():
    shapes = []

    def fn(b, h, q, k):
        shapes.append(torch.broadcast_shapes(q.shape, k.shape))
        return k <= q

    attnperf.block_mask(fn, None, None, 300, 500, block_size=64)
    assert shapes == [(1, 1, 64, 500)] * 4 + [(1, 1, 44, 500)]


BAD = {
    "block_size_odd": (lambda: attnperf.block_mask(layouts.causal(), 1, 1, 8, 8, block_size=24),
                       ValueError, "block_size must be one of"),
    "block_size_pair": (lambda: attnperf.block_mask(layouts.causal(), 1, 1, 8, 8,
                                                    block_size=(16, 256)),
                        ValueError, "block_size must be one of"),
    "negative_length": (lambda: attnperf.block_mask(layouts.causal(), 1, 1, -1, 8),
                        ValueError, "L must be an int >= 0"),
    "zero_heads": (lambda: attnperf.block_mask(layouts.causal(), 1, 0, 8, 8),
                   ValueError, "H must be an int >= 1 or None"),
    "not_bool": (lambda: attnperf.block_mask(lambda b, h, q, k: (k - q).float(), 1, 1, 8, 8),
                 TypeError, "mask_fn must return a bool tensor, got a torch.float32 tensor"),
    "dense_not_bool": (lambda: BlockMask.from_dense(torch.ones(8, 8)),
                       TypeError, "mask must be a bool tensor"),
    "window_zero": (lambda: layouts.sliding_window(0), ValueError, "window must be an int >= 1"),
    "prefix_negative": (lambda: layouts.prefix_lm(-1), ValueError, "prefix_length must be"),
    "document_offsets": (lambda: layouts.document(torch.tensor([1, 4])), ValueError,
                         "starting at 0"),
    "document_decreasing": (lambda: layouts.document(torch.tensor([0, 4, 2])), ValueError,
                            "non-decreasing"),
}  # fmt: skip


@pytest.mark.parametrize("make, error, message", BAD.values(), ids=BAD.keys())
def test_bad_layouts_are_refused_clearly(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_tokens_past_the_documents_attend_nothing():
    fn = layouts.document(torch.tensor([0, 3, 5]))
    dense = attnperf.block_mask(fn, None, None, 7, 7, block_size=16).to_dense()[0, 0]
    assert dense[:3, :3].all() and dense[3:5, 3:5].all()
    assert dense.sum() == 3 * 3 + 2 * 2  # nothing else, past the documents neither


def test_allowed_pairs_counts_the_dense_mask():
    for fn in PATTERNS.values():
        layout = attnperf.block_mask(fn, 2, 3, 100, 93, block_size=(32, 16))
        assert layout.allowed_pairs() == int(layout.to_dense().sum())
