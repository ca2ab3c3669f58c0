"""`autotune estimate` output and the help texts."""

import json
import os
import subprocess
import sys

import pytest

from autotune.cli import build_parser, main
from conftest import EXAMPLES

LLAMA = os.path.join(EXAMPLES, "llama2-7b.yaml")


def test_estimate_json_has_the_documented_keys(capsys):
    assert main(["estimate", LLAMA, "--zero-stage", "3", "--micro-batch-size", "2", "--checkpointing", "full",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_parameters"] == 6_738_415_616
    assert out["strategy"]["zero_stage"] == 3 and out["strategy"]["micro_batch_size"] == 2
    mem = out["gpu_memory_bytes"]
    assert set(mem) >= {"parameters", "gradients", "optimizer_states", "activations", "logits", "buffers",
                        "overhead", "peak"}
    assert all(isinstance(v, int) and v >= 0 for v in mem.values())
    assert out["fits"] is True and out["reasons"] == []
    assert out["deepspeed_config"]["zero_optimization"]["stage"] == 3
    assert out["step_time_s"] > 0 and 0 < out["mfu"] < 1 and out["tokens_per_s_per_gpu"] > 0
    assert set(out["time_breakdown_s"]) >= {"compute", "recompute", "exposed_communication", "offload", "optimizer"}
    assert abs(sum(out["time_breakdown_s"].values()) - out["step_time_s"]) < 1e-6 * out["step_time_s"] + 1e-9
    assert out["calibrated"] is True and out["fsdp"]["sharding_strategy"] == "FULL_SHARD"


def test_estimate_table_and_does_not_fit_reasons(capsys):
    one_gpu = os.path.join(EXAMPLES, "llama2-7b-1gpu.yaml")
    assert main(["estimate", one_gpu]) == 0
    text = capsys.readouterr().out
    for row in ("parameters", "gradients", "optimizer states", "activations", "peak allocated", "GPU memory needed",
                "usable of the GPU"):
        assert row in text
    assert "DOES NOT FIT" in text and "GiB" in text
    assert main(["estimate", one_gpu, "--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu",
                 "--checkpointing", "full", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["cpu_memory_bytes"] > 16 * 6.7e9  # fp32 master + moments + grads on the host


def test_host_ram_under_zero_optimizer_offload_is_called_a_lower_bound(capsys):
    """The recipes that ran out of host RAM were sized below it (docs/long-context.md): said, not silent."""
    assert main(["estimate", LLAMA, "--zero-stage", "3", "--offload-optimizer", "cpu"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("CPU RAM / node")]
    assert "a lower bound under ZeRO optimizer offload" in line
    assert main(["estimate", LLAMA, "--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu",
                 "--engine", "deepspeed"]) == 0
    assert "a lower bound" in capsys.readouterr().out
    assert main(["estimate", LLAMA, "--engine", "fsdp2", "--offload-params", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "CPU RAM / node" in out and "a lower bound" not in out


def test_uncalibrated_gpu_is_marked(write, capsys):
    path = write("model: {preset: gpt2}\ntraining: {seq_len: 1024, global_batch_size: 8}\n"
                 "hardware: {gpu: h200-141gb, gpus_per_node: 1}\n")
    assert main(["estimate", path]) == 0
    assert "uncalibrated" in capsys.readouterr().out


def test_every_option_has_help():
    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices  # argparse keeps them here
    assert {"estimate", "run", "show", "compare", "worker"} <= set(subs)
    for name, sub in subs.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings} has no help"


def test_help_exits_zero():
    for args in (["--help"], ["estimate", "--help"], ["run", "--help"]):
        proc = subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "usage: autotune" in proc.stdout


def _table_value(text: str, label: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.lstrip("=+ ").startswith(label))
    return float(line[len(label) + (len(line) - len(line.lstrip("=+ "))):].split()[0])


@pytest.mark.parametrize("flags", [[], ["--zero-stage", "3", "--micro-batch-size", "2", "--checkpointing", "full"],
                                   ["--zero-stage", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu"]])
def test_estimate_table_adds_up_to_what_fits_compares(capsys, flags):
    """Components at the peak sum to the peak allocated; plus the overhead, to the figure compared
    with the usable capacity (the verdict's own number)."""
    assert main(["estimate", LLAMA, *flags]) == 0
    text = capsys.readouterr().out
    parts = [_table_value(text, k) for k in ("parameters", "gradients", "optimizer states", "activations", "logits",
                                             "buffers")]
    peak, overhead, needed = (_table_value(text, k) for k in ("peak allocated", "context and allocator",
                                                               "GPU memory needed"))
    assert abs(sum(parts) - peak) <= 0.035  # six values rounded to 0.01
    assert abs(peak + overhead - needed) <= 0.015
    assert main(["estimate", LLAMA, *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu_total_bytes"] == out["gpu_memory_bytes"]["peak"] + out["gpu_memory_bytes"]["overhead"]
    assert out["fits"] == (out["gpu_total_bytes"] <= out["gpu_usable_bytes"])


@pytest.mark.parametrize("job,flags,says", [
    ("mixtral-8x7b.yaml", ["--expert-parallel-size", "8", "--offload-params", "cpu"],
     "; expert parallel 8: 1 of 8 experts per GPU, mesh [1, 8] (dp_shard_mod_ep x dp_shard_in_ep)"),
    ("llama3.1-8b-long.yaml", ["--context-parallel-size", "2"], "; context parallel 2: mesh [4, 2] (dp_shard x cp)"),
    ("llama2-7b.yaml", [], "mesh [8]\n")])
def test_estimate_names_an_fsdp2_points_expert_and_context_meshes(capsys, job, flags, says):
    assert main(["estimate", os.path.join(EXAMPLES, job), "--engine", "fsdp2", *flags]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines(keepends=True) if x.startswith("FSDP2: "))
    assert says in line and ("parallel" in line) == bool(flags), line


def test_an_expert_parallel_estimate_says_what_routing_it_assumed(capsys, tmp_path):
    """The routing is unknown to the model: an EP estimate names the load factors it sized with (autotune's
    defaults: a collapsed router's, docs/moe.md Load imbalance)."""
    mixtral = os.path.join(EXAMPLES, "mixtral-8x7b.yaml")
    flags = ["--engine", "fsdp2", "--expert-parallel-size", "8"]
    # Mixtral's busiest expert may take every token (8 experts / top-2 = 4 x the mean); a rank, what it gets when
    # every token picks the same two experts and both are on it (EP 2, 4) or one is (EP 8): ep x j / 2; over
    # a step's 32 blocks, each picking its own two, less (32 x 2 picks: 41 on one of 2 ranks, 25 of 4, 16 of 8)
    for ep, rank, step in (("2", 2.0, 1.28125), ("4", 4.0, 1.5625), ("8", 4.0, 2.0)):
        assert main(["estimate", mixtral, "--engine", "fsdp2", "--expert-parallel-size", ep]) == 0
        (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("routed loads: ")]
        assert (f"busiest expert 4 x the mean, least 0 x, busiest EP rank {rank:g} x, over a "
                f"step {step:g} x (autotune's defaults") in line
    assert main(["estimate", mixtral, *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["routed_load_factors"] == {
        "busiest_expert": 4.0, "least_expert": 0.0, "busiest_rank": 4.0,
        "busiest_rank_step": 2.0, "stated": False, "stated_keys": []}
    assert main(["estimate", mixtral, "--engine", "fsdp2", "--json"]) == 0
    assert "routed_load_factors" not in json.loads(capsys.readouterr().out)
    import yaml

    job = yaml.safe_load(open(mixtral))
    job["model"].update(moe_load_imbalance=1.2, ep_rank_imbalance=1.1,
                        hf_config=os.path.normpath(os.path.join(EXAMPLES, job["model"]["hf_config"])))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["estimate", str(tmp_path / "job.yaml"), *flags]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("routed loads: ")]
    assert ("busiest expert 1.2 x the mean, least 0 x, busiest EP rank 1.1 x, over a step 1.1 x (the rest autotune's "
            "defaults: state model.moe_min_load and model.ep_step_imbalance from your model's routing") in line
    # the least-loaded chunk: a tighter bound on the backward's chunk loop; the rank's rows over a step: on the blocks'
    job["model"].update(moe_min_load=0.8, ep_step_imbalance=1.05)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["estimate", str(tmp_path / "job.yaml"), *flags]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("routed loads: ")]
    assert "busiest expert 1.2 x the mean, least 0.8 x, busiest EP rank 1.1 x, over a step 1.05 x (as the job states them)" in line
    assert main(["estimate", str(tmp_path / "job.yaml"), *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["routed_load_factors"]["least_expert"] == 0.8
    # the rank's default: at most the expert's
    job["model"].update(moe_load_imbalance=1.2, ep_rank_imbalance=None, moe_min_load=None, ep_step_imbalance=None)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["estimate", str(tmp_path / "job.yaml"), *flags]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("routed loads: ")]
    assert "busiest expert 1.2 x the mean, least 0 x, busiest EP rank 1.2 x, over a step 1.2 x" in line


def test_tiny_model_estimate_in_mib(capsys):
    assert main(["estimate", os.path.join(EXAMPLES, "tiny-cpu.yaml")]) == 0
    text = capsys.readouterr().out
    assert "MiB" in text and _table_value(text, "peak allocated") > 0.5


def test_version():
    from autotune import __version__

    proc = subprocess.run([sys.executable, "-m", "autotune", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"autotune {__version__}"


def test_trace_without_torch_is_one_line(tmp_path):
    """estimate --trace on the light install: one line saying which extra to install, exit 2."""
    blocker = tmp_path / "torch.py"
    blocker.write_text("raise ImportError('no torch in this install')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "autotune", "estimate", LLAMA, "--trace"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "error: --trace: needs torch" in proc.stderr and "[profile]" in proc.stderr
