"""`scute.ops.table_writes`: rows of device tables written from the host in one copy and one launch. The kernel in
Triton's interpreter on the CPU (`tests/interpreter.py`), on the GPU there; `TableWrites` on the GPU against the
same rows written one by one (on the CPU, `TableWrites` writes each row by itself)."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import DEVICE, interpreter_module, spy_launches, use_interpreter

FRESH_PROCESS = use_interpreter()  # before triton is imported (tests/interpreter.py)
pytest.importorskip("triton")

from scute.ops import table_writes as tw  # noqa: E402
from scute.ops.kernels import scatter  # noqa: E402

_in_interpreter_process, test_in_a_fresh_interpreter_process = interpreter_module(__file__, FRESH_PROCESS)


def _tables(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(-9, 9, (3, 5, 18), generator=g).to(DEVICE),  # a pool's table [P, slots, fields]
            torch.randint(-9, 9, (4, 7), generator=g).to(DEVICE))


def test_scatter_rows_stores_each_row_at_its_address(monkeypatch):
    g = torch.Generator().manual_seed(0)
    table, other = _tables(g)
    want_table, want_other = table.clone(), other.clone()
    rows = [(table, (0, 2)), (table, (2, 2)), (other, (3,)), (table, (1, 4))]
    addresses, offsets, values = [], [0], []
    for t, index in rows:
        row = torch.randint(100, 200, (t.shape[-1],), generator=g).tolist()
        addresses.append(t.data_ptr() + 8 * sum(i * st for i, st in zip(index, t.stride())))
        values += row
        offsets.append(len(values))
        (want_table if t is table else want_other)[index] = torch.tensor(row, device=DEVICE)
    seen = spy_launches(monkeypatch, scatter, "scatter_rows_kernel")
    tw.scatter_rows(torch.tensor(addresses + offsets + values, dtype=torch.int64, device=DEVICE), len(rows), 18)
    assert seen == [("scatter_rows_kernel", (4,))]
    assert torch.equal(table, want_table) and torch.equal(other, want_other)  # those rows, nothing else


def test_table_writes_flush_once_as_rows_written_one_by_one(monkeypatch):
    g = torch.Generator().manual_seed(1)
    table, other = _tables(g)
    want_table, want_other = table.clone(), other.clone()
    writes = tw.TableWrites()
    for t, want, index in [(table, want_table, (1, 3)), (other, want_other, (0,)), (table, want_table, (2, 0))]:
        row = torch.randint(100, 200, (t.shape[-1],), generator=g).tolist()
        writes.add(t, index, row)
        want[index] = torch.tensor(row, device=DEVICE)
    assert not torch.equal(table, want_table), "nothing written before the flush"
    seen = spy_launches(monkeypatch, scatter, "scatter_rows_kernel")
    writes.flush()
    assert len(seen) == (DEVICE == "cuda"), "one launch on the GPU; on the CPU each row by itself"
    assert torch.equal(table, want_table) and torch.equal(other, want_other)
    with pytest.raises(ValueError, match="rows of contiguous int64 tables"):
        writes.add(table, (0, 0), [1, 2])  # part of a row, from its start


def test_copy_rows_copies_each_source_or_sets_ones(monkeypatch):
    g = torch.Generator().manual_seed(2)
    table, long = torch.randn(3, 5, 12, generator=g).to(DEVICE), torch.randn(2, 1500, generator=g).to(DEVICE)
    want_table, want_long = table.clone(), long.clone()
    sources = [torch.randn(12, generator=g).to(DEVICE), None, torch.randn(1500, generator=g).to(DEVICE)]
    rows = [(table, (0, 3), sources[0]), (table, (2, 1), None), (long, (1,), sources[2])]
    for t, index, src in rows:
        (want_table if t is table else want_long)[index] = 1.0 if src is None else src
    n = len(rows)
    buf = [t.data_ptr() + 4 * sum(i * st for i, st in zip(index, t.stride())) for t, index, _ in rows]
    buf += [0 if src is None else src.data_ptr() for _, _, src in rows] + [t.shape[-1] for t, _, _ in rows]
    seen = spy_launches(monkeypatch, scatter, "copy_rows_kernel")
    tw.copy_rows(torch.tensor(buf, dtype=torch.int64, device=DEVICE), n, 1500)  # 1500: more than one block
    assert seen == [("copy_rows_kernel", (3,))]
    assert torch.equal(table, want_table) and torch.equal(long, want_long)


def test_table_writes_copies_vectors_at_the_flush(monkeypatch):
    g = torch.Generator().manual_seed(3)
    ints, floats = torch.zeros(2, 4, 18, dtype=torch.int64, device=DEVICE), torch.zeros(2, 4, 8, device=DEVICE)
    m = torch.randn(8, generator=g).to(DEVICE)
    writes = tw.TableWrites()
    writes.add(ints, (1, 2), list(range(18)))
    writes.add(ints, (0, 3, 5), [7, 8])  # from an element on
    writes.copy(floats, (0, 2), m)
    writes.copy(floats, (1, 2), None)
    assert not floats.any(), "nothing written before the flush"
    seen = spy_launches(monkeypatch, scatter, "scatter_rows_kernel", "copy_rows_kernel")
    writes.flush()
    assert len(seen) == (2 if DEVICE == "cuda" else 0)
    assert ints[1, 2].tolist() == list(range(18)) and ints[0, 3].tolist() == [0] * 5 + [7, 8] + [0] * 11
    assert int(ints.count_nonzero()) == 17 + 2 and torch.equal(floats[0, 2], m)
    assert torch.equal(floats[1, 2], torch.ones(8, device=DEVICE)) and not floats[:, :2].any()
    with pytest.raises(ValueError, match="whole rows"):
        writes.copy(floats, (0, 0), torch.ones(3, device=DEVICE))


def test_the_flush_addresses_are_the_rows_own():
    """The addresses a CUDA flush sends (`TableWrites._address`, from each table's address and strides, looked up
    once per table) are those of the rows themselves: int64 and float32 tables, a strided view, rows and elements."""
    writes = tw.TableWrites()
    cases = [(torch.zeros(3, 5, 7, dtype=torch.int64), [(1,), (2, 3), (1, 4, 2)]),
             (torch.zeros(4, 6)[1:, 2:], [(0,), (2,), (1, 3)])]
    for table, indices in cases:
        for index in indices:
            assert writes._address(table, index) == table[index].data_ptr(), (table.shape, index)


def test_add_column_writes_a_slots_rows_of_every_projection():
    """`add_column`: rows p = 0, 1, ... of slot s, as `add` of each; checked once, whole rows of a [P, slots,
    width] int64 table only."""
    ints = torch.zeros(3, 4, 18, dtype=torch.int64, device=DEVICE)
    rows = [[p * 100 + f for f in range(18)] for p in range(3)]
    writes = tw.TableWrites()
    writes.add_column(ints, 2, rows)
    writes.flush()
    assert ints[:, 2].tolist() == rows and not ints[:, [0, 1, 3]].any()
    for bad, col in [(ints, [[1] * 17] * 3), (ints, [[1] * 18] * 4), (ints[0], [[1] * 18]),
                     (torch.zeros(3, 4, 18, device=DEVICE), [[1] * 18])]:
        with pytest.raises(ValueError, match="whole rows"):
            writes.add_column(bad, 0, col)


def test_a_tables_geometry_is_kept_across_writes_until_the_table_dies(monkeypatch):
    """`_table` works a table out once for every `TableWrites` (a placement's): later ones find it; an entry made
    for another table, one that died and whose id a new table has, is never taken for it (its weak reference tells
    them apart)."""
    monkeypatch.setattr(tw.TableWrites, "_TABLES", {})
    table = torch.zeros(3, 5, 7, dtype=torch.int64)
    first = tw.TableWrites._table(table)
    assert tw.TableWrites()._table(table) is first and len(tw.TableWrites._TABLES) == 1
    other = torch.zeros(2, 9, dtype=torch.int64)
    tw.TableWrites._TABLES[id(other)] = tw.TableWrites._TABLES.pop(id(table))  # as if `other` had `table`'s id
    assert tw.TableWrites._table(other) == (2, 9, other.data_ptr(), (72, 8))
    assert tw.TableWrites()._address(other, (1,)) == other[1].data_ptr()
