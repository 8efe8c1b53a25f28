// Forgiving variants of the one-click templates ("retry-*"): the same page as the base template
// draws, but a click on a wrong candidate does not end the episode. The candidate is crossed out
// (greyed, struck through, disabled) and the agent may pick again until it clicks the target or
// runs out of turns. The score is the base template's: 1 only when the last pick is the target.
// A policy that tries another candidate after a miss succeeds more often than one that repeats
// its pick: error recovery that oracle demonstrations (one click, on the target) never show.
(function () {
  "use strict";
  const T = window.CUA_TEMPLATES;
  const forgiving = (base, pick) => (c, R, h) => {
    T[base](c, R, h);
    let last = null;  // the candidate the last click landed on
    c.root.addEventListener("click", (ev) => { last = ev.target.closest(pick); }, true);
    c.forgive = () => {
      if (!last) return;
      last.disabled = true;
      Object.assign(last.style, { opacity: "0.3", textDecoration: "line-through", pointerEvents: "none", outline: "3px solid #444" });
      last = null;
    };
  };
  T["retry-color"] = forgiving("click-color", "button");
  T["retry-label"] = forgiving("click-label", "button");
  T["retry-tabs"] = forgiving("nav-tabs", "span");
})();
