// The page side of the built-in task suite.
//
// task.html?t=<template>&seed=<int>[&view=<name>] runs one template (templates.js) with a
// deterministic RNG seeded from (template, seed). A template sets, on `cua`:
//   instruction        the goal shown to the agent
//   score(answer)      the checker: final page state (+ the agent's Answer text) -> [0, 1]
//   plan()             the oracle: element-level steps, resolved to pixels by the env
// and calls cua.finish() when the episode's decisive action has happened (a submit, a click on
// a candidate, reaching a leaf page). Multi-page templates keep state in sessionStorage
// (cua.state / cua.save()) and navigate with real page loads (cua.url(view)).
(function () {
  "use strict";
  const params = new URLSearchParams(location.search);
  let NAME = params.get("t") || "";
  let SEED = parseInt(params.get("seed") || "0", 10) || 0;
  let VIEW = params.get("view") || "main";

  function hash(s) {  // FNV-1a, 32 bit
    let h = 2166136261;
    for (let i = 0; i < s.length; i++) { h ^= s.charCodeAt(i); h = Math.imul(h, 16777619); }
    return h >>> 0;
  }
  function mulberry32(a) {
    return function () {
      a |= 0; a = (a + 0x6d2b79f5) | 0;
      let t = Math.imul(a ^ (a >>> 15), 1 | a);
      t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }
  let gen = mulberry32(hash(NAME + "|" + SEED));
  const rnd = () => gen();
  const R = {
    random: rnd,
    int: (lo, hi) => lo + Math.floor(rnd() * (hi - lo)),  // [lo, hi)
    choice: (a) => a[Math.floor(rnd() * a.length)],
    shuffle: (a) => { a = a.slice(); for (let i = a.length - 1; i > 0; i--) { const j = Math.floor(rnd() * (i + 1)); [a[i], a[j]] = [a[j], a[i]]; } return a; },
    sample: (a, k) => R.shuffle(a).slice(0, k),
  };

  // h("button", {id: "x", class: "big", onclick: f}, "text", child, ...)
  function h(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else if (k === "style" && typeof v === "object") Object.assign(e.style, v);
      else if (v === true) e.setAttribute(k, "");
      else if (v !== false && v != null) e.setAttribute(k, v);
    }
    for (const c of kids.flat()) if (c != null) e.append(c instanceof Node ? c : String(c));
    return e;
  }

  // What an element is called, for the checker's report: its label's text, its own text,
  // aria-label or title, else its id.
  function labelOf(e) {
    const lab = e.closest && e.closest("label");
    const text = ((lab && lab.innerText) || e.innerText || e.value || "").trim().replace(/\s+/g, " ");
    return (text || e.getAttribute("aria-label") || e.getAttribute("title") || e.id || e.tagName.toLowerCase()).slice(0, 40);
  }
  // Every press the page gets, kept in cua.state (across the page loads of multi-page templates)
  document.addEventListener("pointerdown", (ev) => {
    const c = window.cua;
    if (!c) return;
    (c.state.__clicks = c.state.__clicks || []).push({ x: Math.round(ev.clientX), y: Math.round(ev.clientY), label: labelOf(ev.target) });
    c.save();
  }, true);

  let KEY = "cua:" + NAME + ":" + SEED;
  let state = {};
  try { state = JSON.parse(sessionStorage.getItem(KEY) || "{}"); } catch (e) { state = {}; }
  const fresh = { instruction: "", ready: false, done: false, error: null, score: () => 0, plan: () => [], explain: null, forgive: null };

  window.cua = {
    name: NAME, seed: SEED, view: VIEW, R: R, h: h,
    instruction: "", ready: false, done: false, error: null,
    state: state,
    save() { sessionStorage.setItem(KEY, JSON.stringify(this.state)); },
    finish() {
      // a forgiving template (templates_retry.js) goes on after a wrong pick
      if (this.forgive && !(this.score() >= 1)) { this.forgive(); return; }
      this.done = true; this.state.__done = true; this.save();
      if (window.__cuaSignal) window.__cuaSignal(0);  // tells the env the episode is over
    },
    url(view) { return "task.html?t=" + encodeURIComponent(NAME) + "&seed=" + SEED + "&view=" + encodeURIComponent(view); },
    go(view) { location.href = this.url(view); },
    score: () => 0,
    plan: () => [],
    forgive: null,  // optional: () => void, called instead of ending the episode on a wrong pick
    explain: null,  // optional: (answer) -> a sentence on what was wrong, added to the report
    root: null,
    // What the checker can tell about an attempt, beyond its score: the clicks the page got
    // (viewport pixels, and what each landed on), the plan's click targets on the current page
    // (their labels and centres), and closeness in [0, 1]: per target, the best of
    // exp(-d / (0.1 * viewport diagonal)) over the clicks, d the distance from the click to the
    // target's box (0 inside it); averaged over the targets (0 with no target or no click).
    report(answer) {
      const clicks = this.state.__clicks || [];
      const scale = 0.1 * Math.hypot(window.innerWidth, window.innerHeight);
      const targets = [];
      for (const st of this.plan() || []) {
        if (st.op !== "click" || !st.sel) continue;
        const e = document.querySelector(st.sel);
        if (!e) continue;  // on another view of a multi-page template
        const r = e.getBoundingClientRect();
        targets.push({ label: labelOf(e), x: Math.round(r.left + r.width / 2), y: Math.round(r.top + r.height / 2), box: [r.left, r.top, r.right, r.bottom] });
      }
      let close = 0;
      for (const t of targets) {
        let best = 0;
        for (const k of clicks) {
          const dx = Math.max(t.box[0] - k.x, 0, k.x - t.box[2]), dy = Math.max(t.box[1] - k.y, 0, k.y - t.box[3]);
          best = Math.max(best, Math.exp(-Math.hypot(dx, dy) / scale));
        }
        close += best / targets.length;
      }
      const note = typeof this.explain === "function" ? String(this.explain(answer) || "") : "";
      return { clicks: clicks, targets: targets.map(({ label, x, y }) => ({ label, x, y })), closeness: close, note: note };
    },
    // Start another (template, seed) in this document without a page load: what a full load of
    // task.html?t=name&seed=seed would give (the env uses it to make resets cheap).
    restart(name, seed) {
      NAME = name; SEED = seed; VIEW = "main";
      gen = mulberry32(hash(NAME + "|" + SEED));
      KEY = "cua:" + NAME + ":" + SEED;
      state = {};
      history.replaceState(null, "", "task.html?t=" + encodeURIComponent(NAME) + "&seed=" + SEED);
      Object.assign(this, fresh, { name: NAME, seed: SEED, view: VIEW, state: state });
      for (const el of Array.from(document.body.children)) if (el.id !== "instr" && el.id !== "root" && el.tagName !== "SCRIPT") el.remove();
      document.getElementById("root").replaceChildren();
      if (document.activeElement && document.activeElement.blur) document.activeElement.blur();
      window.scrollTo(0, 0);
      this.boot();
      return this.ready;
    },
    boot() {
      this.root = document.getElementById("root");
      const tpl = (window.CUA_TEMPLATES || {})[NAME];
      if (!tpl) { this.error = "unknown template " + NAME; this.root.textContent = this.error; return; }
      if (state.__done) this.finish();
      tpl(this, R, h);
      document.getElementById("instr").textContent = this.instruction;
      this.ready = true;
    },
  };
})();
