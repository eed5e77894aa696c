"""grpo-run-report on hand-written job dirs: ordering, labels, final values, missing keys, the PNG."""

import json
from pathlib import Path

import yaml

from grpo_run import metrics as M
from grpo_run.tracking.report import build_table, curve_panels, curves_figure, load_sweep, main, plot_curves


def write_job(job: Path, overrides: list[str], grpo: dict, rows: list[dict]) -> None:
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / "config_resolved.yaml").write_text(yaml.safe_dump({"grpo": grpo}))
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def rows(reward: list[float], kl: list[float] | None = None, **extra) -> list[dict]:
    out = []
    for i, r in enumerate(reward):
        row = {"step": i + 1, M.REWARD_MEAN: r, M.CLIP_FRACTION: 0.1 * i, M.FRAC_REWARD_ZERO_STD: 0.5}
        row[M.STEP_S] = 0.25  # 4 steps per second
        if kl is not None:
            row[M.KL] = kl[i]
        out.append(row | extra)
    return out


def make_sweep(root: Path) -> Path:
    sweep = root / "sweep"
    fixed = ["model=tiny", "trainer.max_steps=3"]
    # Jobs 2 and 10: sorted as numbers, not as text ("10" < "2").
    write_job(
        sweep / "10",
        [*fixed, "grpo.beta=0.04"],
        {"beta": 0.04, "epsilon": 0.2, "group_size": 8},
        rows([0.1, 0.3, 0.6], [0.0, 0.01, 0.02]),
    )
    write_job(
        sweep / "2",
        [*fixed, "grpo.beta=0"],
        {"beta": 0.0, "epsilon": 0.2, "group_size": 8},
        rows([0.1, 0.2, "NaN"]),
    )
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    (sweep / "7").mkdir()  # a job that failed before writing metrics: no row
    return sweep


def test_jobs_are_read_in_job_order_and_named_by_what_varies(tmp_path):
    jobs = load_sweep(make_sweep(tmp_path))
    assert [j.path.name for j in jobs] == ["2", "10"]
    assert [j.label for j in jobs] == ["beta=0", "beta=0.04"]
    assert [(j.beta, j.epsilon, j.group_size) for j in jobs] == [(0.0, 0.2, 8), (0.04, 0.2, 8)]


def test_final_values_missing_keys_and_rates(tmp_path):
    no_kl, with_kl = load_sweep(make_sweep(tmp_path))
    assert with_kl.final(M.REWARD_MEAN) == 0.6 and with_kl.final(M.KL) == 0.02
    assert with_kl.final(M.CLIP_FRACTION) == 0.2  # 0.1 * step index 2
    assert no_kl.final(M.KL) is None  # beta = 0 logs no KL
    assert str(no_kl.final(M.REWARD_MEAN)) == "nan"  # non-finite values are kept, as strings in jsonl
    assert with_kl.steps_per_s() == 4.0
    assert with_kl.series(M.KL) == ([1, 2, 3], [0.0, 0.01, 0.02])


def test_table_has_one_row_per_job_and_eval_only_when_logged(tmp_path):
    sweep = make_sweep(tmp_path)
    table = build_table(load_sweep(sweep))
    assert table.row_count == 2
    headers = [c.header for c in table.columns]
    assert "eval acc" not in headers and headers[:4] == ["job", "β", "ε", "G"]
    kl_cells = list(table.columns[headers.index("KL")].cells)
    assert kl_cells == ["–", "0.0200"]

    # As the trainer logs it: step 0 holds only the evaluation before training.
    evaluated = [{"step": 0, M.EVAL_ACCURACY: 0.5}, *rows([0.1, 0.2], **{M.EVAL_ACCURACY: 0.75})]
    write_job(sweep / "11", ["grpo.beta=0.1"], {"beta": 0.1, "epsilon": 0.1, "group_size": 4}, evaluated)
    table = build_table(load_sweep(sweep))
    headers = [c.header for c in table.columns]
    assert table.row_count == 3 and list(table.columns[headers.index("eval acc")].cells)[-1] == "0.750"
    assert list(table.columns[headers.index("steps")].cells)[-1] == "2"
    assert list(table.columns[headers.index("steps/s")].cells)[-1] == "4.00"


def test_png_and_command_line(tmp_path, capsys):
    sweep = make_sweep(tmp_path)
    png = plot_curves(load_sweep(sweep), tmp_path / "out" / "curves.png")
    assert png.read_bytes().startswith(b"\x89PNG")
    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "beta=0.04" in out and (sweep / "report.png").exists()
    assert main([str(tmp_path / "empty")]) == 1


def panel_titles_and_points(jobs) -> list[tuple[str, int]]:
    import matplotlib.pyplot as plt

    fig = curves_figure(jobs)
    try:
        return [(ax.get_title(), sum(len(line.get_xdata()) for line in ax.get_lines())) for ax in fig.axes]
    finally:
        plt.close(fig)


def beta0_sweep(root: Path, **extra) -> Path:
    sweep = root / "beta0"
    for i, eps in enumerate((0.1, 0.2)):
        grpo = {"beta": 0.0, "epsilon": eps, "group_size": 4}
        write_job(sweep / str(i), [f"grpo.epsilon={eps}"], grpo, rows([0.1, 0.2, 0.4], **extra))
    return sweep


def test_kl_panel_when_a_job_logged_kl(tmp_path):
    # make_sweep has one job at beta = 0.04 (3 KL points) and one at beta = 0 (none)
    jobs = load_sweep(make_sweep(tmp_path))
    assert curve_panels(jobs) == [(M.REWARD_MEAN, "reward mean"), (M.KL, "KL (k3)")]
    assert panel_titles_and_points(jobs) == [("reward mean", 6), ("KL (k3)", 3)]


def test_beta_zero_sweep_draws_a_logged_metric_instead_of_an_empty_kl_panel(tmp_path):
    # Every job at beta = 0: no train/kl anywhere. rows() logs the clip fraction at every step.
    jobs = load_sweep(beta0_sweep(tmp_path))
    assert panel_titles_and_points(jobs) == [("reward mean", 6), ("clip fraction", 6)]
    # Entropy is preferred to the clip fraction, held-out accuracy to both.
    jobs = load_sweep(beta0_sweep(tmp_path / "e", **{M.ENTROPY: 1.5}))
    assert panel_titles_and_points(jobs) == [("reward mean", 6), ("entropy", 6)]
    jobs = load_sweep(beta0_sweep(tmp_path / "a", **{M.ENTROPY: 1.5, M.EVAL_ACCURACY: 0.3}))
    assert panel_titles_and_points(jobs) == [("reward mean", 6), ("held-out accuracy", 6)]


def test_no_second_metric_logged_says_so(tmp_path):
    sweep = tmp_path / "bare"
    write_job(
        sweep / "0", [], {"beta": 0.0, "epsilon": 0.2, "group_size": 4}, [{"step": 1, M.REWARD_MEAN: 0.5}]
    )
    jobs = load_sweep(sweep)
    assert curve_panels(jobs)[1] == (M.KL, "KL (k3)")
    import matplotlib.pyplot as plt

    fig = curves_figure(jobs)
    texts = [t.get_text() for t in fig.axes[1].texts]
    plt.close(fig)
    assert texts == [f"no job logged {M.KL}"]


def test_a_reward_model_job_gets_its_score_beside_the_held_out_accuracy(tmp_path):
    # Job 0 trained against a classifier named "rm" (and logged math_verifier beside it); job 1 is plain
    # GRPO. Only job 0's proxy is drawn: 3 score points on the left axis, 2 evaluations on the right.
    sweep = tmp_path / "rm"
    grpo = {"beta": 0.0, "epsilon": 0.2, "group_size": 4}
    functions = [{"name": "rm", "model": {"path": "x", "kind": "classifier"}}, {"name": "math_verifier"}]
    scored = rows(
        [0.1, 0.2, 0.3], **{M.REWARD_FN_MEAN.format("rm"): 1.5, M.REWARD_FN_MEAN.format("math_verifier"): 0.2}
    )
    scored[0][M.EVAL_ACCURACY] = scored[2][M.EVAL_ACCURACY] = 0.4
    write_job(sweep / "0", ["trainer.seed=0"], grpo, scored)
    config = yaml.safe_load((sweep / "0" / "config_resolved.yaml").read_text())
    (sweep / "0" / "config_resolved.yaml").write_text(
        yaml.safe_dump(config | {"reward": {"functions": functions}})
    )
    write_job(sweep / "1", ["trainer.seed=1"], grpo, rows([0.1, 0.2, 0.3], **{M.EVAL_ACCURACY: 0.3}))
    jobs = load_sweep(sweep)
    assert [j.model_rewards for j in jobs] == [["rm"], []]
    import matplotlib.pyplot as plt

    fig = curves_figure(jobs)
    proxy, truth = fig.axes[2], fig.axes[3]  # the proxy panel and its twin (right) axis
    assert [len(line.get_xdata()) for line in proxy.lines] == [3]
    assert [list(line.get_ydata()) for line in truth.lines] == [[0.4, 0.4]]
    assert proxy.get_ylabel() == "model reward mean" and truth.get_ylabel() == "held-out accuracy"
    plt.close(fig)
    # Without an evaluation there is no truth to hold the proxy against: two panels, as before.
    write_job(tmp_path / "noeval" / "0", [], grpo, rows([0.1], **{M.REWARD_FN_MEAN.format("rm"): 1.0}))
    fig = curves_figure(load_sweep(tmp_path / "noeval"))
    assert len(fig.axes) == 2
    plt.close(fig)


def test_a_run_with_its_own_reward_shows_its_held_out_reward(tmp_path):
    """eval.reward on data without gold answers: eval/reward_mean and no eval/accuracy. The table has an
    eval reward column (no eval acc column) and the second panel draws it at beta = 0."""
    jobs = load_sweep(beta0_sweep(tmp_path, **{M.ENTROPY: 1.5, M.EVAL_REWARD_MEAN: -0.25}))
    table = build_table(jobs)
    headers = [c.header for c in table.columns]
    assert "eval acc" not in headers
    assert list(table.columns[headers.index("eval reward")].cells) == ["-0.250", "-0.250"]
    assert panel_titles_and_points(jobs) == [("reward mean", 6), ("held-out reward (eval.reward)", 6)]
    # Without it, no such column.
    assert "eval reward" not in [
        c.header for c in build_table(load_sweep(beta0_sweep(tmp_path / "b"))).columns
    ]
