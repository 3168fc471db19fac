"""DataProto: the container between driver and workers."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ketch.protocol import DataProto, DataProtoError, pad_to_divisor, unpad


def make(n: int = 4) -> DataProto:
    return DataProto.from_single_dict(
        {"x": torch.arange(n * 2).view(n, 2), "uid": [f"u{i}" for i in range(n)]}, meta_info={"t": 1.0}
    )


def test_from_single_dict_sorts_tensors_and_objects():
    data = make()
    assert list(data.batch) == ["x"] and list(data.non_tensor_batch) == ["uid"]
    assert data.non_tensor_batch["uid"].dtype == object
    assert len(data) == 4


def test_length_mismatch_names_the_keys():
    with pytest.raises(DataProtoError, match=r"batch\['x'\]: 3, non_tensor_batch\['y'\]: 2"):
        DataProto.from_single_dict({"x": torch.zeros(3), "y": ["a", "b"]})


def test_int_index_gives_a_row_and_slices_give_dataprotos():
    data = make()
    assert data[1]["uid"] == "u1" and data[1]["x"].tolist() == [2, 3]
    assert data[1:3].non_tensor_batch["uid"].tolist() == ["u1", "u2"]
    assert data[[3, 0]].batch["x"][:, 0].tolist() == [6, 0]
    assert data[np.array([True, False, True, False])].non_tensor_batch["uid"].tolist() == ["u0", "u2"]


def test_select_and_pop():
    data = make().union(DataProto.from_dict({"y": torch.ones(4)}))
    picked = data.select(batch_keys=["y"], non_tensor_keys=[])
    assert list(picked.batch) == ["y"] and picked.non_tensor_batch == {}
    popped = data.pop(batch_keys=["x"], meta_keys=["t"])
    assert list(popped.batch) == ["x"] and popped.meta_info == {"t": 1.0}
    assert list(data.batch) == ["y"] and data.meta_info == {}


def test_select_missing_key_lists_present_keys():
    with pytest.raises(DataProtoError, match=r"batch has no key\(s\) \['nope'\]; it has \['x'\]"):
        make().select(batch_keys=["nope"])


def test_union_checks_shared_keys_agree():
    data = make()
    same = DataProto.from_dict({"x": data.batch["x"].clone(), "z": torch.zeros(4)})
    assert sorted(data.union(same).batch) == ["x", "z"]
    different = DataProto.from_dict({"x": torch.zeros(4, 2, dtype=torch.long)})
    with pytest.raises(DataProtoError, match=r"union: batch\['x'\] differs"):
        data.union(different)


def test_chunk_uneven_points_at_padding():
    with pytest.raises(DataProtoError, match=r"length 4 into 3 equal parts; pad it first"):
        make().chunk(3)


def test_pad_then_chunk_then_unpad_restores_rows():
    data = make(5)
    padded, pad = pad_to_divisor(data, 4)
    assert (len(padded), pad) == (8, 3)
    assert padded.non_tensor_batch["uid"][5:].tolist() == ["u0", "u1", "u2"]
    parts = padded.chunk(4)
    restored = unpad(DataProto.concat(parts), pad)
    assert torch.equal(restored.batch["x"], data.batch["x"])


def test_split_keeps_a_short_tail():
    assert [len(p) for p in make(5).split(2)] == [2, 2, 1]


def test_repeat_interleaved_and_tiled():
    data = make(2)
    assert data.repeat(2).non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1"]
    assert data.repeat(2, interleave=False).non_tensor_batch["uid"].tolist() == ["u0", "u1", "u0", "u1"]


def test_concat_rejects_different_keys():
    with pytest.raises(DataProtoError, match=r"part 1 has keys"):
        DataProto.concat([make(), DataProto.from_dict({"x": torch.zeros(1, 2)})])


def test_save_and_load_round_trip(tmp_path):
    data = make()
    data.save_to_disk(tmp_path / "d.pt")
    loaded = DataProto.load_from_disk(tmp_path / "d.pt")
    assert torch.equal(loaded.batch["x"], data.batch["x"])
    assert loaded.non_tensor_batch["uid"].tolist() == data.non_tensor_batch["uid"].tolist()
    assert loaded.meta_info == {"t": 1.0}


def test_reorder_applies_a_permutation():
    data = make().reorder([2, 0, 3, 1])
    assert data.non_tensor_batch["uid"].tolist() == ["u2", "u0", "u3", "u1"]
    assert data.batch["x"][:, 0].tolist() == [4, 0, 6, 2]


@given(n=st.integers(1, 40), k=st.integers(1, 8))
def test_pad_chunk_concat_unpad_is_the_identity(n, k):
    data = make(n)
    padded, pad = pad_to_divisor(data, k)
    back = unpad(DataProto.concat(padded.chunk(k)), pad)
    assert torch.equal(back.batch["x"], data.batch["x"])
    assert back.non_tensor_batch["uid"].tolist() == data.non_tensor_batch["uid"].tolist()


def test_pickling_keeps_tensors_dtypes_and_objects():
    import pickle

    data = make()
    data.batch["half"] = torch.ones(4, 2, dtype=torch.bfloat16)
    back = pickle.loads(pickle.dumps(data, protocol=5))
    assert torch.equal(back.batch["x"], data.batch["x"]) and back.batch["half"].dtype == torch.bfloat16
    back.batch["x"] += 1  # writable, not a view of the pickle buffer
    assert back.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3"] and back.meta_info == {"t": 1.0}
