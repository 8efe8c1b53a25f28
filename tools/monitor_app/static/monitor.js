// cua_jax monitor: live curves (uPlot, vendored), live tables, the rollout player.
// Pages poll JSON every few seconds: a running run's new steps appear without a reload.
"use strict";
const CuaMonitor = (() => {
  const PANELS = [
    { title: "success", keys: ["rollout/success", "eval/success"] },
    { title: "reward", keys: ["rollout/reward", "rollout/score", "eval/reward"] },
    { title: "entropy", keys: ["train/entropy"] },
    { title: "KL", keys: ["train/kl"] },
    { title: "clip fractions", keys: ["train/clip_frac_low", "train/clip_frac_high"] },
    { title: "staleness (versions)", keys: ["rollout/staleness_mean", "rollout/staleness_max"] },
    { title: "throughput (generated tokens / s)", keys: ["throughput/tokens_per_s"] },
    { title: "loss", keys: ["train/loss"] },
  ];
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

  function num(v) { return typeof v === "number" && isFinite(v) ? v : null; }
  function fmt(v) { return typeof v === "number" ? String(Number(v.toPrecision(3))) : ""; }
  function esc(s) { return String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`); }
  const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];

  function derived(m) {
    const tok = num(m["rollout/generated_tokens"]), t = num(m["time/step"]);
    return { ...m, "throughput/tokens_per_s": tok !== null && t ? tok / t : null };
  }

  async function getJSON(url) {
    const r = await fetch(url, { credentials: "same-origin" });
    if (!r.ok) throw new Error(url + ": " + r.status);
    return r.json();
  }

  function runPage(runId, pollMs) {
    const steps = [];
    const charts = [];
    let last = -1;
    const box = document.getElementById("charts");
    const width = () => Math.max(320, Math.min(560, box.clientWidth / 2 - 24));

    function series(keys) {
      return [steps.map((s) => s.step), ...keys.map((k) => steps.map((s) => num(s.metrics[k])))];
    }
    function build() {
      for (const p of PANELS) {
        const keys = p.keys.filter((k) => steps.some((s) => num(s.metrics[k]) !== null));
        if (!keys.length || charts.some((c) => c.panel === p)) continue;
        const div = document.createElement("div");
        div.className = "chart";
        div.dataset.title = p.title;
        div.innerHTML = "<h3></h3>";
        div.firstChild.textContent = p.title;
        box.appendChild(div);
        const opts = {
          width: width(), height: 200,
          // a flat series (0 staleness, 0 clip fraction) gets [0, max(1, 2v)], not [0, 100]
          scales: { x: { time: false }, y: { range: (u, lo, hi) => (lo !== hi
            ? uPlot.rangeNum(lo, hi, 0.1, true)
            : lo >= 0 ? [0, Math.max(1, 2 * hi)] : [lo - 1, hi + 1]) } },
          axes: [{ label: "step", incrs: STEP_INCRS }, {}],
          series: [{ label: "step" }, ...keys.map((k, i) => ({
            label: k, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
            points: { show: steps.length < 60 },
          }))],
        };
        charts.push({ panel: p, keys, plot: new uPlot(opts, series(keys), div) });
      }
    }
    function redraw() {
      build();
      for (const c of charts) c.plot.setData(series(c.keys));
    }
    function addRows(rows) {
      const body = document.querySelector("#steps tbody");
      for (const s of rows) {
        if (body.querySelector(`tr[data-step="${s.step}"]`)) continue;
        const m = s.metrics, tr = document.createElement("tr");
        tr.dataset.step = s.step;
        const cells = [s.groups, m["rollout/reward"], m["rollout/success"], m["train/loss"],
          m["eval/success"], m["time/step"]];
        tr.innerHTML = `<td><a href="/runs/${runId}/steps/${esc(s.step)}">${esc(s.step)}</a></td>` +
          cells.map((v) => `<td>${fmt(v)}</td>`).join("");
        body.insertBefore(tr, body.firstChild);
      }
    }
    let nEvals = document.querySelectorAll("#evals tbody a").length;
    function showEvals(evals) {
      if (evals.length === nEvals) return;
      nEvals = evals.length;
      document.querySelector("#evals tbody").innerHTML = evals.map((e) =>
        // every value escaped: a row's fields are whatever the database holds
        `<tr><td><a href="/runs/${runId}/evals/${esc(e.step)}?tag=${encodeURIComponent(e.tag)}">` +
        `${esc(e.step)}</a></td><td>${esc(e.tag)}</td><td>${fmt(e.success)}</td>` +
        `<td>${esc(e.num_tasks)}</td></tr>`).join("");
    }
    async function poll() {
      try {
        const data = await getJSON(`/api/runs/${runId}/steps?after=${last}`);
        showEvals(data.evals);
        const fresh = data.steps.map((s) => ({ ...s, metrics: derived(s.metrics) }));
        for (const s of fresh) {
          const i = steps.findIndex((o) => o.step === s.step);
          if (i >= 0) steps[i] = s; else steps.push(s);
          last = Math.max(last, s.step);
        }
        if (fresh.length) { redraw(); addRows(fresh); }
        document.getElementById("status-text").textContent = data.run.status;
        document.getElementById("run-status").textContent = data.run.status;
        document.getElementById("run-status").className = "status" + (data.run.running ? " live" : "");
        document.getElementById("last-step").textContent = data.run.last_step ?? "—";
        document.getElementById("updated").textContent = "updated " + data.run.updated;
        if (data.run.running) {
          // the last step may still gain its eval metrics: re-read it next time
          last = Math.max(-1, last - 1);
        }
        document.body.dataset.loadedSteps = String(steps.length);
        if (!data.run.running && data.run.status !== "running") return;  // finished: stop
      } catch (e) {
        console.warn(e);
      }
      setTimeout(poll, pollMs);
    }
    window.addEventListener("resize", () => charts.forEach((c) => c.plot.setSize({ width: width(), height: 200 })));
    poll();
  }

  function pollRuns(pollMs) {
    async function poll() {
      try {
        const runs = await getJSON("/api/runs");
        const body = document.querySelector("#runs tbody");
        for (const r of runs) {
          const tr = body.querySelector(`tr[data-run="${r.id}"]`);
          if (!tr) { location.reload(); return; }  // a new run: redraw the list
          tr.querySelector(".status").textContent = r.status;
          tr.querySelector(".status").className = "status" + (r.running ? " live" : "");
          tr.querySelector(".last-step").textContent = r.last_step ?? "";
        }
      } catch (e) { console.warn(e); }
      setTimeout(poll, pollMs);
    }
    setTimeout(poll, pollMs);
  }

  function player() {
    const turns = [...document.querySelectorAll("section.turn")];
    if (!turns.length) return;
    let i = 0, timer = null;
    const all = document.getElementById("show-all");
    const label = document.getElementById("turn-label");
    function show() {
      turns.forEach((t, k) => { t.style.display = all.checked || k === i ? "" : "none"; });
      label.textContent = all.checked ? `${turns.length} turns` : `turn ${i + 1} / ${turns.length}`;
    }
    function go(d) { i = Math.min(turns.length - 1, Math.max(0, i + d)); show(); }
    document.getElementById("prev").onclick = () => go(-1);
    document.getElementById("next").onclick = () => go(1);
    document.getElementById("play").onclick = (ev) => {
      if (timer) { clearInterval(timer); timer = null; ev.target.textContent = "▶ play"; return; }
      all.checked = false; i = 0; show(); ev.target.textContent = "❚❚ pause";
      timer = setInterval(() => { if (i >= turns.length - 1) { clearInterval(timer); timer = null; document.getElementById("play").textContent = "▶ play"; } else go(1); }, 1500);
    };
    all.onchange = show;
    document.addEventListener("keydown", (e) => { if (e.key === "ArrowLeft") go(-1); if (e.key === "ArrowRight") go(1); });
    show();
  }

  return { runPage, pollRuns, player };
})();
