"""`bench/profile_load.py` on the CPU with a narrow 2-layer model: both tables, the median load's timeline, its
stretches between pause points, and the parts it times inside a load put back as they were."""

from __future__ import annotations

from tests.helpers import bench_module


def test_profile_load_times_each_part_and_puts_them_back(tmp_path, capsys):
    import scute.adapters.checkpoint as checkpoint
    import scute.adapters.conversion as conversion
    from scute.adapters.checkpoint import AdapterCheckpoint
    from scute.adapters.safetensors_file import Digest
    from scute.engine.adapter_loader import AdapterLoader, Turns

    def parts():
        return (Turns.pause, AdapterLoader.submit, vars(AdapterLoader)["matrix_dtype"], conversion.read_checkpoint,
                conversion.convert_checkpoint, conversion.fold_layers, Digest.hexdigest, AdapterLoader.device_copy,
                *(vars(AdapterCheckpoint)[p] for p in ("tensors_on", "arriving", "land", "verify", "buffer")),
                checkpoint.read_safetensors)

    before = parts()
    result = bench_module("profile_load").main(["--device", "cpu", "--layers", "2", "--hidden", "64", "--repeats",
                                                "1", "--root", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "synchronized: each phase alone" in printed and "as run: the parts of one load" in printed
    run = result["as_run"]["lora"]
    assert list(run) == ["read", "checked", "arriving", "convert", "fold", "prepare", "land", "read_wait", "verify",
                         "hash_wait", "device", "job", "place"]
    assert run["job"] >= run["convert"] >= run["checked"] > 0 and run["read"] > 0 and run["fold"] > 0
    assert result["synchronized"]["lora"]["convert"] > 0
    timeline = result["timeline"]["lora"]  # the median job's parts, from its start: within the job, placed after
    job = next((a, b) for part, a, b in timeline if part == "job")
    assert job[0] == 0 and all(0 <= a <= b <= job[1] for part, a, b in timeline if part not in ("job", "place"))
    assert {"read", "convert", "prepare"} <= {part for part, _, _ in timeline}
    assert next(a for part, a, _ in timeline if part == "place") >= job[1]
    stretches = result["stretches"]["lora"]  # from the job's start to its first pause point, ..., to its end
    assert any(k.startswith("start of _job -> ") for k in stretches) and any(k.endswith("-> end of the job")
                                                                             for k in stretches)
    assert [st["cpu_max_ms"] for st in stretches.values()] == sorted((st["cpu_max_ms"] for st in stretches.values()),
                                                                     reverse=True)
    assert all(st["count"] > 0 and st["wall_max_ms"] >= st["wall_median_ms"] > 0 and st["cpu_max_ms"] >= 0
               for st in stretches.values())
    assert parts() == before
    # --served: the GPU's path for a LoRA file in the serving dtype (its views before its values, landed later)
    served = bench_module("profile_load").main(["--device", "cpu", "--layers", "2", "--hidden", "64", "--repeats",
                                                "1", "--root", str(tmp_path), "--served"])["as_run"]["lora"]
    assert served["arriving"] > 0 and served["land"] > 0 and served["checked"] == 0 and run["arriving"] == 0
    assert parts() == before
