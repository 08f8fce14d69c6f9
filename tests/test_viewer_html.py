"""``agentrl view``: real trajectories from the envs, written to one HTML file, opened in headless
Chromium (Playwright driving Debian's /usr/bin/chromium): filters, clicking a trajectory, the rendered
turns, tool calls, token strips and the log-prob gap heat map; no network request is made."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

import agentrl.envs as envs
from agentrl.harmony import HarmonyFormat, Message, Trajectory
from agentrl.viewer.html import load_view_items, main, write_html

CHROMIUM = os.environ.get("AGENTRL_CHROMIUM", "/usr/bin/chromium")
FMT = HarmonyFormat()


async def _episodes() -> list[Trajectory]:
    """Three real episodes: retool with a python call and a right answer, retool with an unknown tool and a
    wrong answer (plus train log-probs, as the trainer records them), gsm8k answered directly."""
    out = []
    env = envs.make("retool", format=FMT)
    try:
        await env.areset(
            options={"task": {"id": "r1", "prompt": "What is 6 * 7? <b>bold</b>", "answer": "42"}}
        )
        await env.astep(FMT.render_completion([
            Message("assistant", "Compute it.", channel="analysis"),
            Message("assistant", "print(6 * 7)", channel="analysis", recipient="python", content_type="code"),
        ]))
        await env.astep(FMT.render_completion([Message("assistant", "It is \\boxed{42}.", channel="final")]))
        out.append(env.trajectory)
        await env.areset(options={"task": {"id": "r2", "prompt": "What is 2 + 2?", "answer": "4"}})
        await env.astep(FMT.render_completion(
            [Message("assistant", "{}", channel="commentary", recipient="functions.ghost", content_type="json")]))
        await env.astep(FMT.render_completion([Message("assistant", "\\boxed{5}", channel="final")]))
        traj = env.trajectory
        traj.rollout_logprobs = [(-0.5 if m else 0.0) for m in traj.response_mask]
        traj.train_logprobs = [
            (-0.5 - 0.01 * (i % 7) if m else 0.0) for i, m in enumerate(traj.response_mask)
        ]
        out.append(traj)
    finally:
        await env.aclose()
    g = envs.make("gsm8k", format=FMT)
    await g.areset(options={"task": {"id": "g1", "prompt": "1 + 1?", "answer": "2"}})
    await g.astep(FMT.render_completion([Message("assistant", "\\boxed{2}", channel="final")]))
    out.append(g.trajectory)
    await g.aclose()
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    trajs = asyncio.run(_episodes())
    (d / "trajectories.jsonl").write_text("".join(t.to_json() + "\n" for t in trajs) + "{not json\n")
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')  # not trajectories: skipped
    return d


def test_load_and_cli(run_dir, capsys):
    items, problems = load_view_items(run_dir)
    assert [t.task["id"] for _, t in items] == ["r1", "r2", "g1"]
    assert len(problems) == 1 and problems[0]["source"] == "trajectories.jsonl:4"
    assert main([str(run_dir), f"out={run_dir / 'view.html'}"]) == 0
    assert "3 trajectories, 1 unreadable lines" in capsys.readouterr().out
    page = (run_dir / "view.html").read_text()
    assert "<b>bold</b>" not in page  # model/user text is escaped inside the JSON
    assert "http://" not in page and "https://" not in page  # nothing to fetch: opens offline
    assert main([str(run_dir / "missing.jsonl")]) == 2  # one line: the path does not exist
    assert main([str(run_dir), f"out={run_dir / 'two.html'}", "limit=2"]) == 0
    assert "2 trajectories" in capsys.readouterr().out


@pytest.mark.skipif(
    not shutil.which(CHROMIUM), reason=f"Chromium not installed at {CHROMIUM} (apt-get install chromium)"
)
def test_viewer_in_headless_chromium(run_dir, tmp_path):
    from playwright.sync_api import sync_playwright

    items, problems = load_view_items(run_dir / "trajectories.jsonl")
    html = write_html(items, tmp_path / "view.html", fmt=FMT, problems=problems)
    shot = tmp_path / "viewer.png"
    external: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.route(
                "**/*",
                lambda route: (
                    route.continue_()
                    if route.request.url.startswith("file:")
                    else (external.append(route.request.url), route.abort())
                ),
            )
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(html.as_uri())
            rows = page.locator("#list .row[data-id]")
            assert rows.count() == 3
            # filters: error type, env, reward
            page.select_option("#f-error", "unknown_tool")
            assert rows.count() == 1
            page.select_option("#f-error", "")
            page.select_option("#f-env", "gsm8k")
            assert rows.count() == 1
            page.select_option("#f-env", "")
            page.fill("#f-rmin", "1")
            assert rows.count() == 2
            page.fill("#f-rmin", "")
            # open the retool trajectory with the python call
            rows.nth(0).click()
            detail = page.locator("#detail")
            assert "What is 6 * 7? <b>bold</b>" in detail.locator(".msg.task").inner_text()  # shown as text
            assert "answer 42" in detail.locator(".msg.task").inner_text()
            turns = detail.locator(".turn")
            assert turns.count() == 2
            first = turns.nth(0)
            assert first.locator(".badge.ch").first.inner_text() == "analysis"
            assert "→ python" in first.inner_text()
            assert "print(6 * 7)" in first.locator(".msg pre").nth(1).inner_text()
            assert first.locator(".tool .result").inner_text() == "42"
            assert "final" in turns.nth(1).inner_text() and "It is \\boxed{42}." in turns.nth(1).inner_text()
            strip = detail.locator(".strip").nth(1)  # the response strip (the prompt one is collapsed)
            t = items[0][1]
            assert strip.locator(".tok.m").count() == sum(t.response_mask)
            assert strip.locator(".tok.e").count() == len(t.response_mask) - sum(t.response_mask)
            assert "".join(strip.locator(".tok").all_inner_texts()) == FMT.decode(t.response_ids)
            assert detail.locator(".strip.gap").count() == 0  # no train log-probs on this one
            # the one with an unknown tool and a log-prob gap
            rows.nth(1).click()
            assert "unknown_tool" in detail.locator(".tool.failed").inner_text()
            gap = detail.locator(".strip.gap")
            assert gap.count() == 1
            colours = set(gap.locator(".tok").evaluate_all("els => els.map(e => e.style.background)"))
            assert len(colours) > 3  # a real heat map, not one colour
            page.screenshot(path=str(shot), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
    assert external == []
    assert shot.stat().st_size > 10_000
    print(f"viewer screenshot: {shot}")
