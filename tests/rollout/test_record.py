"""Rollout record: cutting padding (`trimmed`, `real_span`) and length-ordered chunks (`by_length`)."""

from __future__ import annotations

import torch

from quartet.rollout.record import Rollout, position_ids_from_mask


def _rollout() -> Rollout:
    prompt_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]]).float()
    prompt_ids = torch.arange(1, 17).view(4, 4) * prompt_mask
    response_ids = torch.arange(20, 40).view(4, 5) * response_mask.long()
    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask, eos=torch.ones(4, dtype=torch.bool),
                   advantages=torch.randn(4, 5))


def test_trimmed_keeps_every_real_token_at_its_position():
    ro = _rollout()
    assert ro.real_span() == (1, 4)  # prompt column 0 and response column 4 are padding in every row
    cut = ro.trimmed()
    assert cut.prompt_ids.shape == (4, 3) and cut.response_ids.shape == (4, 4) and cut.advantages.shape == (4, 4)
    for full, short in ((ro.input_ids, cut.input_ids), (ro.attention_mask, cut.attention_mask)):
        keep = ro.attention_mask.bool()
        assert torch.equal(full[keep], short[cut.attention_mask.bool()])
    real = ro.attention_mask.bool()
    assert torch.equal(position_ids_from_mask(ro.attention_mask)[real],
                       position_ids_from_mask(cut.attention_mask)[cut.attention_mask.bool()])
    # a span taken from a larger set of rows cuts a subset to the same widths
    assert ro.select([2]).trimmed(ro.real_span()).response_ids.shape == (1, 4)


def test_by_length_yields_every_row_once_in_order_of_length_each_chunk_cut_to_its_own():
    ro = _rollout()
    chunks = list(ro.by_length(2))
    assert [rows for rows, _ in chunks] == [[2, 0], [3, 1]]  # 2, 4, 5 and 7 real tokens
    (_, short), (_, long) = chunks
    assert short.prompt_ids.shape[1] == 2 and short.response_ids.shape[1] == 2
    assert long.prompt_ids.shape[1] == 3 and long.response_ids.shape[1] == 4
    assert torch.equal(long.advantages, ro.advantages[[3, 1], :4])


def test_trunk_states_are_cut_with_the_tokens_they_belong_to():
    """(B, T, H) trunk states: `trimmed` keeps the columns of the tokens it keeps, `select` the rows."""
    ro = _rollout()
    ro.trunk = ro.input_ids.float()[:, :, None].expand(4, 9, 2).clone()  # each state names its token
    for rows in ([0, 1, 2, 3], [2], [3, 1]):
        part = ro.select(rows)
        for cut in (part.trimmed(), part.trimmed(ro.real_span())):
            assert cut.trunk.shape[:2] == cut.input_ids.shape
            assert torch.equal(cut.trunk[:, :, 0], cut.input_ids.float())
            assert torch.equal(cut.trunk[:, :, 1], cut.input_ids.float())


def test_to_moves_every_tensor_and_keeps_the_texts():
    ro = _rollout()
    ro.prompts, ro.responses = ["p"] * 4, ["r"] * 4
    assert ro.to("cpu") is ro  # already there: no copy
    meta = ro.to("meta")  # a second device, on any machine
    tensors = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "eos", "advantages")
    assert all(getattr(meta, name).device.type == "meta" for name in tensors)
    assert meta.old_logprobs is None and meta.prompts == ro.prompts and meta.responses == ro.responses
    assert all(getattr(ro, name).device.type == "cpu" for name in tensors)  # the original is left as it was


def test_a_noted_shared_prefix_travels_with_its_rows_and_no_further():
    """`prefix_tokens`, counted on the host before the rows go to a GPU, is what the forwards use; `trimmed` and `to`
    keep it (the same rows), `select` and `concat` drop it (other rows may share more or less)."""
    from quartet.models.prefix import MIN_SHARED_TOKENS
    from quartet.rollout.forward import noted_prefix, shared_prefix
    from quartet.rollout.record import concat

    n = MIN_SHARED_TOKENS + 2
    system = torch.arange(100, 100 + n)
    prompt_ids = torch.stack([torch.cat([system, torch.tensor([7, 8])]), torch.cat([system, torch.tensor([9, 9])])])
    ro = Rollout(prompt_ids, torch.ones_like(prompt_ids), torch.tensor([[5, 6], [5, 0]]),
                 torch.tensor([[1.0, 1.0], [1.0, 0.0]]), eos=torch.ones(2, dtype=torch.bool))
    assert ro.prefix_tokens is None and shared_prefix(ro)[0] == n  # counted from the ids
    noted = noted_prefix(ro)
    assert noted is ro and ro.prefix_tokens == n
    assert ro.trimmed().prefix_tokens == n and ro.to("meta").prefix_tokens == n
    assert shared_prefix(ro.to("meta"))[0] == n  # read from the note: the ids on the device are not read
    assert ro.select([0, 1]).prefix_tokens is None and concat([ro, ro], 0).prefix_tokens is None
    ro.prefix_tokens = 0  # a note says there is nothing to share
    assert shared_prefix(ro) is None
