// The built-in task templates. Each is fn(cua, R, h): draw every random choice first (the same
// draws on every view of a multi-page template), render, and set cua.instruction / cua.score /
// cua.plan. Metadata (category, difficulty, held-out) lives in envs/browser/suite.py.
(function () {
  "use strict";
  const T = (window.CUA_TEMPLATES = {});
  const COLORS = { red: "#d62728", green: "#2ca02c", blue: "#1f77b4", orange: "#ff7f0e", purple: "#9467bd", yellow: "#e6c700", pink: "#e377c2", gray: "#888888" };
  const WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "piano", "lemon", "rocket", "garden", "silver", "forest", "candle", "window", "planet", "marble", "violet", "copper", "harbor", "pepper"];
  const NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emil", "Fatima", "Goran", "Hana", "Ivan", "Julia", "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya"];
  const FRUITS = ["Apple", "Banana", "Cherry", "Date", "Elderberry", "Fig", "Grape", "Kiwi", "Lemon", "Mango", "Nectarine", "Olive", "Papaya", "Quince", "Raspberry", "Strawberry", "Tangerine", "Ugli", "Vanilla", "Watermelon", "Yuzu", "Zucchini", "Apricot", "Blueberry", "Coconut", "Guava", "Lime", "Melon", "Peach", "Pear"];
  const SETTINGS = ["Wi-Fi", "Bluetooth", "Dark mode", "Notifications", "Auto update", "Location", "Sync", "Sounds"];
  const LABELS = ["Save", "Cancel", "Delete", "Open", "Print", "Share", "Copy", "Help", "Edit", "Send"];
  const colorNames = Object.keys(COLORS);
  const submit = (h, onclick, label) => h("button", { id: "submit", class: "big", onclick: onclick }, label || "Submit");
  const area = (h) => h("div", { style: { position: "relative", height: "68vh", minHeight: "150px" } });
  const place = (R, el, maxLeft, maxTop) => { el.style.position = "absolute"; el.style.left = R.int(0, maxLeft) + "%"; el.style.top = R.int(0, maxTop) + "%"; return el; };
  const phrase = (R, n) => R.sample(WORDS, n).join(" ");
  // cua.explain of a form (the checker's note on a failed attempt): each field whose value is
  // not the wanted one ([name, () => value, wanted]), then whether the form was sent at all
  // (`sent()` null: "<how> was not done").
  const formNote = (fields, sent, how) => () => {
    const parts = [];
    for (const [name, get, want] of fields) {
      const v = String(get() ?? "");
      if (v.trim() !== String(want)) parts.push(v.trim() ? name + ' holds "' + v + '"; it should hold "' + want + '"' : name + ' is empty; it should hold "' + want + '"');
    }
    if (sent() === null) parts.push(how + " was not done");
    return parts.length ? parts.join(". ") + "." : "";
  };
  // cua.explain of a choice: what is chosen now (or that nothing is), what should be, and
  // whether it was confirmed.
  const choiceNote = (what, got, want, sent, how) => () => {
    const g = got();
    const parts = [];
    if (g !== want) parts.push((g === null || g === "" ? "No " + what + " is chosen" : 'The ' + what + ' chosen is "' + g + '"') + '; it should be "' + want + '"');
    if (sent() === null) parts.push(how + " was not done");
    return parts.length ? parts.join(". ") + "." : "";
  };

  // ------------------------------------------------------------------------------ click
  T["click-button"] = (c, R, h) => {
    const label = R.choice(["OK", "Submit", "Go", "Next", "Start", "Continue"]);
    const left = R.int(0, 55), top = R.int(0, 60);
    c.instruction = 'Click the "' + label + '" button.';
    let hit = false;
    const a = area(h);
    const b = h("button", { id: "target", class: "big", style: { position: "absolute", left: left + "%", top: top + "%" }, onclick: () => { hit = true; c.finish(); } }, label);
    a.append(b); c.root.append(a);
    c.score = () => (hit ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#target" }];
  };

  T["click-color"] = (c, R, h) => {
    const cols = R.sample(colorNames, R.int(2, 4));
    const target = R.choice(cols);
    c.instruction = "Click the " + target + " button.";
    let clicked = null;
    const row = h("div", { class: "row", style: { gap: "24px", marginTop: "20px" } });
    cols.forEach((col, i) => row.append(h("button", { id: "b-" + col, class: "big", style: { background: COLORS[col], minWidth: "110px", minHeight: "70px" }, onclick: () => { clicked = col; c.finish(); } }, "")));
    c.root.append(row);
    c.score = () => (clicked === target ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#b-" + target }];
  };

  T["click-label"] = (c, R, h) => {
    const labels = R.sample(LABELS, R.int(3, 6));
    const target = R.choice(labels);
    c.instruction = 'Click the button labeled "' + target + '".';
    let clicked = null;
    const row = h("div", { class: "row" });
    labels.forEach((l) => row.append(h("button", { id: "b-" + l, class: "big", onclick: () => { clicked = l; c.finish(); } }, l)));
    c.root.append(row);
    c.score = () => (clicked === target ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#b-" + target }];
  };

  T["click-link"] = (c, R, h) => {
    const words = R.sample(WORDS, 5);
    const target = R.choice(words);
    c.instruction = 'Click the link "' + target + '".';
    let clicked = null;
    const p = h("div", { class: "box" });
    words.forEach((w, i) => { p.append(h("p", {}, "Item " + (i + 1) + ": ", h("a", { href: "#", id: "l-" + w, onclick: (e) => { e.preventDefault(); clicked = w; c.finish(); } }, w))); });
    c.root.append(p);
    c.score = () => (clicked === target ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#l-" + target }];
  };

  T["click-shape"] = (c, R, h) => {
    const shapes = ["circle", "square", "triangle"];
    const combos = [];
    for (const s of shapes) for (const col of ["red", "green", "blue", "orange"]) combos.push([col, s]);
    const picked = R.sample(combos, 6);
    const target = picked[0];
    const order = R.shuffle(picked);
    c.instruction = "Click the " + target[0] + " " + target[1] + ".";
    let clicked = null;
    const row = h("div", { class: "row" });
    order.forEach(([col, s]) => {
      const st = { background: COLORS[col] };
      if (s === "circle") st.borderRadius = "50%";
      if (s === "triangle") st.clipPath = "polygon(50% 0, 100% 100%, 0 100%)";
      row.append(h("div", { id: "s-" + col + "-" + s, class: "shape", style: st, onclick: () => { clicked = col + "-" + s; c.finish(); } }));
    });
    c.root.append(row);
    c.score = () => (clicked === target.join("-") ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#s-" + target.join("-"), frac: [0.5, 0.6] }];
  };

  T["double-click"] = (c, R, h) => {
    const cols = R.sample(colorNames, 3);
    const target = R.choice(cols);
    c.instruction = "Double-click the " + target + " box.";
    let clicked = null;
    const row = h("div", { class: "row", style: { gap: "24px" } });
    cols.forEach((col) => row.append(h("div", { id: "d-" + col, style: { width: "90px", height: "70px", background: COLORS[col], border: "2px solid #333" }, ondblclick: () => { clicked = col; c.finish(); } })));
    c.root.append(row);
    c.score = () => (clicked === target ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#d-" + target, count: 2 }];
  };

  T["right-click"] = (c, R, h) => {
    const files = R.sample(WORDS, 4).map((w) => w + R.choice([".txt", ".png", ".pdf"]));
    const target = R.choice(files);
    c.instruction = 'Right-click the file "' + target + '".';
    let clicked = null;
    const list = h("div", { class: "box", style: { width: "260px" } });
    files.forEach((f, i) => list.append(h("div", { id: "f-" + i, style: { padding: "8px", borderBottom: "1px solid #ccc" }, oncontextmenu: (e) => { e.preventDefault(); clicked = f; c.finish(); } }, "\u{1F4C4} " + f)));
    c.root.append(list);
    c.score = () => (clicked === target ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#f-" + files.indexOf(target), button: "right" }];
  };

  T["click-sequence"] = (c, R, h) => {
    const labels = R.sample(["A", "B", "C", "D", "E", "F"], 4);
    const [first, second] = R.sample(labels, 2);
    c.instruction = 'Click button "' + first + '", then button "' + second + '".';
    const clicks = [];
    const row = h("div", { class: "row" });
    labels.forEach((l) => row.append(h("button", { id: "b-" + l, class: "big", onclick: () => { clicks.push(l); if (clicks.length >= 2) c.finish(); } }, l)));
    c.root.append(row);
    c.score = () => (clicks[0] === first && clicks[1] === second ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#b-" + first }, { op: "click", sel: "#b-" + second }];
  };

  // ------------------------------------------------------------------------------ forms
  T["type-word"] = (c, R, h) => {
    const word = R.choice(WORDS);
    c.instruction = 'Type "' + word + '" into the text box and click Submit.';
    let sent = null;
    const inp = h("input", { type: "text", id: "field" });
    c.root.append(h("div", { class: "row" }, inp), submit(h, () => { sent = inp.value; c.finish(); }));
    setTimeout(() => inp.focus(), 0);
    inp.focus();
    c.score = () => (sent !== null && sent.trim() === word ? 1 : 0);
    c.explain = formNote([["The text box", () => inp.value, word]], () => sent, "Clicking Submit");
    c.plan = () => [{ op: "click", sel: "#field" }, { op: "type", text: word }, { op: "click", sel: "#submit" }];
  };

  T["enter-name-email"] = (c, R, h) => {
    const name = R.choice(NAMES), email = name.toLowerCase() + R.int(1, 99) + "@example.com";
    c.instruction = 'Enter the name "' + name + '" and the email "' + email + '", then click Submit.';
    let sent = null;
    const n = h("input", { type: "text", id: "name" }), e = h("input", { type: "text", id: "email" });
    c.root.append(h("label", {}, "Name ", n), h("label", {}, "Email ", e), submit(h, () => { sent = [n.value, e.value]; c.finish(); }));
    c.score = () => (sent && sent[0].trim() === name && sent[1].trim() === email ? 1 : 0);
    c.explain = formNote([["The Name field", () => n.value, name], ["The Email field", () => e.value, email]], () => sent, "Clicking Submit");
    c.plan = () => [{ op: "click", sel: "#name" }, { op: "type", text: name }, { op: "click", sel: "#email" }, { op: "type", text: email }, { op: "click", sel: "#submit" }];
  };

  T["login-form"] = (c, R, h) => {
    const user = R.choice(NAMES).toLowerCase(), pw = R.choice(WORDS) + R.int(10, 99);
    c.instruction = 'Log in with username "' + user + '" and password "' + pw + '".';
    let sent = null;
    const u = h("input", { type: "text", id: "user" }), p = h("input", { type: "password", id: "pass" });
    c.root.append(h("label", {}, "Username ", u), h("label", {}, "Password ", p), submit(h, () => { sent = [u.value, p.value]; c.finish(); }, "Log in"));
    c.score = () => (sent && sent[0] === user && sent[1] === pw ? 1 : 0);
    c.explain = formNote([["The Username field", () => u.value, user], ["The Password field", () => p.value, pw]], () => sent, "Clicking Log in");
    c.plan = () => [{ op: "click", sel: "#user" }, { op: "type", text: user }, { op: "click", sel: "#pass" }, { op: "type", text: pw }, { op: "click", sel: "#submit" }];
  };

  T["enter-number"] = (c, R, h) => {
    const n = R.int(2, 500);
    c.instruction = "Enter " + n + " in the quantity box and press Enter.";
    let sent = null;
    const q = h("input", { type: "text", id: "qty", onkeydown: (e) => { if (e.key === "Enter") { sent = q.value; c.finish(); } } });
    c.root.append(h("label", {}, "Quantity ", q));
    c.score = () => (sent !== null && sent.trim() === String(n) ? 1 : 0);
    c.explain = formNote([["The quantity box", () => q.value, n]], () => sent, "Pressing Enter in the quantity box");
    c.plan = () => [{ op: "click", sel: "#qty" }, { op: "type", text: String(n) }, { op: "key", keys: ["enter"] }];
  };

  T["search-query"] = (c, R, h) => {
    const q = phrase(R, 2);
    c.instruction = 'Search for "' + q + '".';
    let sent = null;
    const inp = h("input", { type: "text", id: "q", placeholder: "Search...", onkeydown: (e) => { if (e.key === "Enter") { sent = inp.value; c.finish(); } } });
    c.root.append(h("div", { class: "row" }, inp, h("button", { id: "go", onclick: () => { sent = inp.value; c.finish(); } }, "Search")));
    c.score = () => (sent !== null && sent.trim().toLowerCase() === q ? 1 : 0);
    c.explain = formNote([["The search box", () => inp.value.toLowerCase(), q]], () => sent, "Running the search");
    c.plan = () => [{ op: "click", sel: "#q" }, { op: "type", text: q }, { op: "key", keys: ["enter"] }];
  };

  T["copy-text"] = (c, R, h) => {
    const text = phrase(R, 3);
    c.instruction = "Type the phrase shown in the grey box into the text field, then click Submit.";
    let sent = null;
    const inp = h("input", { type: "text", id: "field" });
    c.root.append(h("div", { id: "phrase", class: "box", style: { background: "#ddd", display: "inline-block", fontSize: "20px" } }, text), h("div", { class: "row" }, inp), submit(h, () => { sent = inp.value; c.finish(); }));
    c.score = () => (sent !== null && sent.trim() === text ? 1 : 0);
    c.explain = formNote([["The text field", () => inp.value, text]], () => sent, "Clicking Submit");
    c.plan = () => [{ op: "click", sel: "#field" }, { op: "type", text: text }, { op: "click", sel: "#submit" }];
  };

  T["fill-address"] = (c, R, h) => {
    const v = { street: R.int(1, 200) + " " + R.choice(["Oak", "Pine", "Elm", "Lake", "Hill"]) + " St", city: R.choice(["Springfield", "Rivertown", "Lakeside", "Hillview"]), zip: String(R.int(10000, 99999)) };
    c.instruction = 'Fill in the address: street "' + v.street + '", city "' + v.city + '", ZIP "' + v.zip + '", then click Save.';
    let sent = null;
    const f = {}; const box = h("div", {});
    for (const k of ["street", "city", "zip"]) { f[k] = h("input", { type: "text", id: k }); box.append(h("label", {}, k[0].toUpperCase() + k.slice(1) + " ", f[k])); }
    c.root.append(box, submit(h, () => { sent = { street: f.street.value, city: f.city.value, zip: f.zip.value }; c.finish(); }, "Save"));
    c.score = () => (sent && ["street", "city", "zip"].every((k) => sent[k].trim() === v[k]) ? 1 : 0);
    c.explain = formNote([["The Street field", () => f.street.value, v.street], ["The City field", () => f.city.value, v.city], ["The Zip field", () => f.zip.value, v.zip]], () => sent, "Clicking Save");
    c.plan = () => ["street", "city", "zip"].flatMap((k) => [{ op: "click", sel: "#" + k }, { op: "type", text: v[k] }]).concat([{ op: "click", sel: "#submit" }]);
  };

  // ------------------------------------------------------------------------------ select
  T["radio-pick"] = (c, R, h) => {
    const opts = R.sample(["Small", "Medium", "Large", "Extra large"], 3);
    const target = R.choice(opts);
    c.instruction = 'Select "' + target + '" and click Submit.';
    let sent = null;
    const box = h("div", { class: "box", style: { display: "inline-block" } });
    opts.forEach((o, i) => box.append(h("label", { style: { fontSize: "18px" } }, h("input", { type: "radio", name: "r", id: "r" + i, value: o, style: { width: "22px", height: "22px" } }), " " + o)));
    c.root.append(box, h("div", {}, submit(h, () => { const s = document.querySelector("input[name=r]:checked"); sent = s ? s.value : ""; c.finish(); })));
    c.score = () => (sent === target ? 1 : 0);
    c.explain = choiceNote("option", () => { const s = document.querySelector("input[name=r]:checked"); return s ? s.value : null; }, target, () => sent, "Clicking Submit");
    c.plan = () => [{ op: "click", sel: "#r" + opts.indexOf(target) }, { op: "click", sel: "#submit" }];
  };

  T["listbox-pick"] = (c, R, h) => {
    const opts = R.sample(FRUITS, 5);
    const target = R.choice(opts);
    c.instruction = 'Choose "' + target + '" from the list and click Submit.';
    let sent = null;
    const sel = h("select", { id: "list", "aria-label": "List", size: String(opts.length), style: { fontSize: "17px", width: "200px" } });
    opts.forEach((o, i) => sel.append(h("option", { id: "o" + i, value: o }, o)));
    c.root.append(sel, h("div", { style: { marginTop: "10px" } }, submit(h, () => { sent = sel.value; c.finish(); })));
    c.score = () => (sent === target ? 1 : 0);
    c.explain = choiceNote("item", () => sel.value || null, target, () => sent, "Clicking Submit");
    c.plan = () => [{ op: "click", sel: "#o" + opts.indexOf(target) }, { op: "click", sel: "#submit" }];
  };

  function dropdown(h, id, opts, label) {
    let value = null;
    // ARIA roles (no visual change) let the select_option API action find it by its label.
    const btn = h("button", { id: id + "-btn", role: "combobox", "aria-label": label, "aria-haspopup": "listbox", "aria-controls": id + "-list" }, label + " \u25BE");
    const list = h("div", { id: id + "-list", role: "listbox", class: "opts", style: { display: "none" } });
    opts.forEach((o, i) => list.append(h("div", { id: id + "-o" + i, role: "option", onclick: () => { value = o; btn.textContent = o + " \u25BE"; list.style.display = "none"; } }, o)));
    btn.addEventListener("click", () => { list.style.display = list.style.display === "none" ? "block" : "none"; });
    return { el: h("div", { class: "dd" }, btn, list), get: () => value };
  }

  T["dropdown-pick"] = (c, R, h) => {
    const opts = R.sample(FRUITS, 5);
    const target = R.choice(opts);
    c.instruction = 'Pick "' + target + '" from the dropdown and click Submit.';
    let sent = null;
    const dd = dropdown(h, "dd", opts, "Choose a fruit");
    c.root.append(h("div", { style: { height: "220px" } }, dd.el), submit(h, () => { sent = dd.get(); c.finish(); }));
    c.score = () => (sent === target ? 1 : 0);
    c.explain = choiceNote("fruit", dd.get, target, () => sent, "Clicking Submit");
    c.plan = () => [{ op: "click", sel: "#dd-btn" }, { op: "click", sel: "#dd-o" + opts.indexOf(target) }, { op: "click", sel: "#submit" }];
  };

  T["two-dropdowns"] = (c, R, h) => {
    const sizes = ["S", "M", "L", "XL"], cols = R.sample(colorNames, 4);
    const ts = R.choice(sizes), tc = R.choice(cols);
    c.instruction = "Choose size " + ts + " and color " + tc + ", then click Add.";
    let sent = null;
    const a = dropdown(h, "size", sizes, "Size"), b = dropdown(h, "color", cols, "Color");
    c.root.append(h("div", { class: "row", style: { height: "200px", alignItems: "flex-start" } }, a.el, b.el), submit(h, () => { sent = [a.get(), b.get()]; c.finish(); }, "Add"));
    c.score = () => (sent && sent[0] === ts && sent[1] === tc ? 1 : 0);
    c.explain = () => [choiceNote("size", a.get, ts, () => 0, "")(), choiceNote("color", b.get, tc, () => sent, "Clicking Add")()].filter(Boolean).join(" ");
    c.plan = () => [{ op: "click", sel: "#size-btn" }, { op: "click", sel: "#size-o" + sizes.indexOf(ts) }, { op: "click", sel: "#color-btn" }, { op: "click", sel: "#color-o" + cols.indexOf(tc) }, { op: "click", sel: "#submit" }];
  };

  T["pick-day"] = (c, R, h) => {
    const day = R.int(1, 29);
    const month = R.choice(["March", "June", "September", "November"]);
    c.instruction = "Pick " + month + " " + day + " in the calendar and click OK.";
    let chosen = null, sent = null;
    const tbl = h("table", { class: "cal" });
    let tr = null;
    for (let d = 1; d <= 28; d++) {
      if ((d - 1) % 7 === 0) { tr = h("tr", {}); tbl.append(tr); }
      const td = h("td", { id: "d" + d, onclick: () => { document.querySelectorAll(".cal td").forEach((x) => (x.style.background = "")); td.style.background = "#9cf"; chosen = d; } }, String(d));
      tr.append(td);
    }
    c.root.append(h("div", { style: { fontWeight: "bold" } }, month), tbl, h("div", { style: { marginTop: "8px" } }, submit(h, () => { sent = chosen; c.finish(); }, "OK")));
    c.score = () => (sent === day ? 1 : 0);
    c.explain = choiceNote("day", () => (chosen === null ? null : month + " " + chosen), month + " " + day, () => sent, "Clicking OK");
    c.plan = () => [{ op: "click", sel: "#d" + day }, { op: "click", sel: "#submit" }];
  };

  // ------------------------------------------------------------------------------ toggles
  function switchEl(h, id, on, onchange, label) {
    // aria-label: what the checker's report calls it (no visual change)
    const s = h("span", { id: id, class: "switch" + (on ? " on" : ""), "aria-label": label || id });
    s.addEventListener("click", () => { s.classList.toggle("on"); if (onchange) onchange(); });
    return s;
  }

  T["toggle-switch"] = (c, R, h) => {
    const name = R.choice(SETTINGS), want = R.random() < 0.5, start = R.random() < 0.3 ? want : !want;
    c.instruction = "Turn " + name + " " + (want ? "on" : "off") + ", then click Save.";
    let saved = null;
    const s = switchEl(h, "sw", start, null, name);
    c.root.append(h("div", { class: "row", style: { fontSize: "18px" } }, name, s), submit(h, () => { saved = s.classList.contains("on"); c.finish(); }, "Save"));
    c.score = () => (saved === want ? 1 : 0);
    c.explain = () => {
      const now = s.classList.contains("on"), parts = [];
      if (now !== want) parts.push(name + " is " + (now ? "on" : "off") + "; it should be " + (want ? "on" : "off"));
      if (saved === null) parts.push("Clicking Save was not done");
      return parts.length ? parts.join(". ") + "." : "";
    };
    c.plan = () => (start === want ? [] : [{ op: "click", sel: "#sw" }]).concat([{ op: "click", sel: "#submit" }]);
  };

  T["checkbox-set"] = (c, R, h) => {
    const items = R.sample(WORDS, 5);
    const want = new Set(R.sample(items, R.int(1, 4)));
    c.instruction = "Check exactly these boxes: " + [...want].join(", ") + ". Then click Submit.";
    let sent = null;
    const box = h("div", { class: "box", style: { display: "inline-block" } });
    items.forEach((w, i) => box.append(h("label", {}, h("input", { type: "checkbox", id: "c" + i, style: { width: "20px", height: "20px" } }), " " + w)));
    c.root.append(box, h("div", {}, submit(h, () => { sent = items.filter((w, i) => document.getElementById("c" + i).checked); c.finish(); })));
    c.score = () => (sent && sent.length === want.size && sent.every((w) => want.has(w)) ? 1 : 0);
    c.explain = () => {
      const on = items.filter((w, i) => document.getElementById("c" + i).checked), parts = [];
      const extra = on.filter((w) => !want.has(w)), missing = [...want].filter((w) => !on.includes(w));
      if (missing.length) parts.push("Not checked but should be: " + missing.join(", "));
      if (extra.length) parts.push("Checked but should not be: " + extra.join(", "));
      if (sent === null) parts.push("Clicking Submit was not done");
      return parts.length ? parts.join(". ") + "." : "";
    };
    c.plan = () => items.map((w, i) => (want.has(w) ? { op: "click", sel: "#c" + i } : null)).filter(Boolean).concat([{ op: "click", sel: "#submit" }]);
  };

  T["settings-panel"] = (c, R, h) => {
    const names = R.sample(SETTINGS, 4);
    const start = names.map(() => R.random() < 0.5);
    const want = names.map(() => R.random() < 0.5);
    if (want.every((w, i) => w === start[i])) want[0] = !want[0];
    const on = names.filter((n, i) => want[i]), off = names.filter((n, i) => !want[i]);
    c.instruction = "Set: " + names.map((n, i) => n + " " + (want[i] ? "on" : "off")).join(", ") + ". Then click Save.";
    let saved = null;
    const sw = names.map((n, i) => switchEl(h, "sw" + i, start[i], null, n));
    names.forEach((n, i) => c.root.append(h("div", { class: "row", style: { justifyContent: "space-between", width: "260px" } }, n, sw[i])));
    c.root.append(submit(h, () => { saved = sw.map((s) => s.classList.contains("on")); c.finish(); }, "Save"));
    c.score = () => (saved && saved.every((v, i) => v === want[i]) ? 1 : 0);
    c.explain = () => {
      const parts = names.flatMap((n, i) => { const now = sw[i].classList.contains("on"); return now === want[i] ? [] : [n + " is " + (now ? "on" : "off") + "; it should be " + (want[i] ? "on" : "off")]; });
      if (saved === null) parts.push("Clicking Save was not done");
      return parts.length ? parts.join(". ") + "." : "";
    };
    c.plan = () => names.map((n, i) => (start[i] !== want[i] ? { op: "click", sel: "#sw" + i } : null)).filter(Boolean).concat([{ op: "click", sel: "#submit" }]);
    void on; void off;
  };

  T["set-slider"] = (c, R, h) => {
    const target = R.int(2, 19) * 5;
    c.instruction = "Set the volume slider to " + target + " (within 5), then click Save.";
    let saved = null;
    const s = h("input", { type: "range", id: "slider", min: "0", max: "100", value: "0", style: { width: "300px", margin: "0", padding: "0" } });
    const out = h("span", { id: "val" }, "0");
    s.addEventListener("input", () => (out.textContent = s.value));
    c.root.append(h("div", { class: "row" }, "Volume", s, out), submit(h, () => { saved = +s.value; c.finish(); }, "Save"));
    c.score = () => (saved !== null && Math.abs(saved - target) <= 5 ? 1 : 0);
    c.explain = () => {
      const v = +s.value, parts = [];
      if (Math.abs(v - target) > 5) parts.push("The volume slider is at " + v + "; it should be at " + target + " (within 5)");
      if (saved === null) parts.push("Clicking Save was not done");
      return parts.length ? parts.join(". ") + "." : "";
    };
    // Chromium's range thumb is ~16px wide: value v sits at 8 + v/100 * (width - 16) px.
    c.plan = () => { const w = s.getBoundingClientRect().width; return [{ op: "click", sel: "#slider", frac: [(8 + (target / 100) * (w - 16)) / w, 0.5] }, { op: "click", sel: "#submit" }]; };
  };

  // ------------------------------------------------------------------------------ scroll
  T["scroll-button"] = (c, R, h) => {
    const labels = R.sample(LABELS, 3);
    const target = labels[2];
    c.instruction = 'Scroll down and click the "' + target + '" button.';
    let clicked = null;
    c.root.append(h("button", { id: "b0", onclick: () => { clicked = labels[0]; c.finish(); } }, labels[0]), h("div", { class: "spacer", style: { height: R.int(700, 1200) + "px" } }, "Keep scrolling \u2193"), h("button", { id: "b1", onclick: () => { clicked = labels[1]; c.finish(); } }, labels[1]), h("div", { class: "spacer", style: { height: R.int(200, 500) + "px" } }), h("button", { id: "b2", class: "big", onclick: () => { clicked = labels[2]; c.finish(); } }, labels[2]), h("div", { style: { height: "200px" } }));
    c.score = () => (clicked === target ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#b2" }];
  };

  T["scroll-list"] = (c, R, h) => {
    const items = R.shuffle(FRUITS).slice(0, 24);
    const target = items[R.int(12, 24)];
    c.instruction = 'Click "' + target + '" in the list.';
    let clicked = null;
    const list = h("div", { class: "list", id: "list" });
    items.forEach((f, i) => list.append(h("div", { id: "i" + i, onclick: () => { clicked = f; c.finish(); } }, f)));
    c.root.append(list);
    c.score = () => (clicked === target ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#i" + items.indexOf(target) }];
  };

  T["scroll-answer"] = (c, R, h) => {
    const code = R.choice(WORDS).toUpperCase() + R.int(10, 99);
    c.instruction = "Scroll to the bottom of the page and answer with the code word written there.";
    c.root.append(h("p", {}, "The code word is at the bottom of this page."), h("div", { class: "spacer", style: { height: R.int(900, 1500) + "px" } }, "\u2193"), h("div", { id: "code", class: "box", style: { fontSize: "22px" } }, "Code word: " + code), h("div", { style: { height: "100px" } }));
    c.score = (answer) => (answer && answer.trim().toUpperCase().replace(/^CODE WORD:\s*/, "") === code ? 1 : 0);
    c.plan = () => [{ op: "see", sel: "#code" }, { op: "answer", text: code }];
  };

  T["scroll-agree"] = (c, R, h) => {
    const n = R.int(25, 45);
    c.instruction = 'Read the terms, tick "I agree" at the end and click Continue.';
    let sent = null;
    const terms = h("div", { id: "terms", style: { height: "180px", overflowY: "auto", border: "2px solid #333", width: "300px", padding: "6px" } });
    for (let i = 1; i <= n; i++) terms.append(h("p", {}, i + ". " + phrase(R, 4) + "."));
    const cb = h("input", { type: "checkbox", id: "agree", style: { width: "20px", height: "20px" } });
    terms.append(h("label", {}, cb, " I agree"), h("button", { id: "cont", onclick: () => { sent = cb.checked; c.finish(); } }, "Continue"));
    c.root.append(terms);
    c.score = () => (sent === true ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#agree" }, { op: "click", sel: "#cont" }];
  };

  // ------------------------------------------------------------------------------ navigation
  T["nav-link"] = (c, R, h) => {
    const pages = R.shuffle(["Home", "About", "Contact", "Pricing", "Blog", "Careers"]).slice(0, 5);
    const target = R.choice(pages.slice(1));
    c.instruction = "Go to the " + target + " page.";
    if (c.view === "main") {
      const nav = h("div", { class: "nav" });
      pages.forEach((p) => nav.append(h("a", { id: "n-" + p, href: c.url(p) }, p)));
      c.root.append(nav, h("h2", {}, "Welcome"), h("p", {}, phrase(R, 6)));
    } else {
      c.state.visited = c.view; c.save(); c.finish();
      c.root.append(h("h2", { id: "title" }, c.view), h("p", {}, "This is the " + c.view + " page."));
    }
    c.score = () => (c.state.visited === target ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#n-" + target }];
  };

  T["nav-tabs"] = (c, R, h) => {
    const tabs = R.sample(["General", "Billing", "Security", "Profile", "Team", "Usage"], 4);
    const target = R.choice(tabs.slice(1));
    c.instruction = 'Open the "' + target + '" tab.';
    let opened = null;
    const bar = h("div", { class: "tabs" });
    const body = h("div", { class: "box", style: { minHeight: "80px" } }, tabs[0] + " settings");
    tabs.forEach((t, i) => bar.append(h("span", { id: "t-" + t, class: i === 0 ? "active" : "", onclick: (e) => { bar.querySelectorAll("span").forEach((s) => (s.className = "")); e.target.className = "active"; body.textContent = t + " settings"; if (i > 0) { opened = t; c.finish(); } } }, t)));
    c.root.append(bar, body);
    c.score = () => (opened === target ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#t-" + target }];
  };

  T["nav-two-level"] = (c, R, h) => {
    const cats = { Laptops: R.sample(["Aero 13", "Book Pro", "Zen 14", "Slim 15", "Flex 11"], 3), Phones: R.sample(["Pixel X", "Nova 9", "Edge 5", "Mi 12", "Lumo"], 3), Cameras: R.sample(["Alpha 7", "Lens Z", "Snap 3", "Shot 10", "Focus"], 3) };
    const cat = R.choice(Object.keys(cats)), item = R.choice(cats[cat]);
    c.instruction = "Open the product page of " + item + " (in " + cat + ").";
    const slug = (s) => s.replace(/\W+/g, "_");
    if (c.view === "main") {
      const nav = h("div", { class: "nav" });
      Object.keys(cats).forEach((k) => nav.append(h("a", { id: "c-" + k, href: c.url("cat:" + k) }, k)));
      c.root.append(h("h2", {}, "Shop"), nav);
    } else if (c.view.startsWith("cat:")) {
      const k = c.view.slice(4);
      const nav = h("div", { class: "nav" });
      (cats[k] || []).forEach((it) => nav.append(h("a", { id: "p-" + slug(it), href: c.url("item:" + it) }, it)));
      c.root.append(h("h2", {}, k), nav, h("p", {}, h("a", { href: c.url("main") }, "\u2190 back")));
    } else {
      c.state.visited = c.view.slice(5); c.save(); c.finish();
      c.root.append(h("h2", {}, c.view.slice(5)), h("p", {}, "Product details."));
    }
    c.score = () => (c.state.visited === item ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#c-" + cat }, { op: "click", sel: "#p-" + slug(item) }];
  };

  T["nav-breadcrumb"] = (c, R, h) => {
    const trail = ["Home"].concat(R.sample(["Docs", "Guides", "Setup", "Linux", "Network", "Advanced"], 3));
    const target = R.choice(trail.slice(0, 3));
    c.instruction = 'Use the breadcrumbs to go to the "' + target + '" page.';
    if (c.view === "main") {
      const bc = h("div", { class: "nav" });
      trail.forEach((t, i) => { if (i < trail.length - 1) { bc.append(h("a", { id: "bc-" + t, href: c.url(t) }, t), " / "); } else bc.append(h("b", {}, t)); });
      c.root.append(bc, h("h2", {}, trail[trail.length - 1]), h("p", {}, phrase(R, 8)));
    } else {
      c.state.visited = c.view; c.save(); c.finish();
      c.root.append(h("h2", {}, c.view));
    }
    c.score = () => (c.state.visited === target ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#bc-" + target }];
  };

  // ------------------------------------------------------------------------------ workflow
  T["login-then-setting"] = (c, R, h) => {
    const user = R.choice(NAMES).toLowerCase(), pw = R.choice(WORDS) + R.int(10, 99);
    const setting = R.choice(SETTINGS), want = R.random() < 0.5;
    c.instruction = 'Log in as "' + user + '" with password "' + pw + '", then turn ' + setting + " " + (want ? "on" : "off") + " and click Save.";
    if (c.view === "main") {
      const u = h("input", { type: "text", id: "user" }), p = h("input", { type: "password", id: "pass" });
      const err = h("div", { style: { color: "#c00" } });
      c.root.append(h("h3", {}, "Sign in"), h("label", {}, "Username ", u), h("label", {}, "Password ", p), err, submit(h, () => { if (u.value === user && p.value === pw) { c.state.logged = true; c.save(); c.go("settings"); } else err.textContent = "Wrong username or password."; }, "Log in"));
    } else if (c.view === "settings" && c.state.logged) {
      const s = switchEl(h, "sw", !want, null, setting);
      c.root.append(h("h3", {}, "Settings"), h("div", { class: "row" }, setting, s), submit(h, () => { c.state.saved = s.classList.contains("on"); c.save(); c.finish(); }, "Save"));
    } else c.root.append(h("p", {}, "Please log in first."));
    c.score = () => (c.state.logged && c.state.saved === want ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#user" }, { op: "type", text: user }, { op: "click", sel: "#pass" }, { op: "type", text: pw }, { op: "click", sel: "#submit" }, { op: "click", sel: "#sw" }, { op: "click", sel: "#submit" }];
  };

  T["cart-checkout"] = (c, R, h) => {
    const items = R.sample(FRUITS, 4);
    const target = R.choice(items);
    c.instruction = "Add " + target + " to the cart, then open the cart and check out.";
    const cart = c.state.cart || [];
    if (c.view === "main") {
      const count = h("a", { id: "cart", href: c.url("cart") }, "Cart (" + cart.length + ")");
      c.root.append(h("div", { class: "nav", style: { textAlign: "right" } }, count));
      items.forEach((f, i) => c.root.append(h("div", { class: "row" }, h("span", { style: { width: "120px" } }, f), h("button", { id: "add" + i, onclick: () => { cart.push(f); c.state.cart = cart; c.save(); count.textContent = "Cart (" + cart.length + ")"; } }, "Add to cart"))));
    } else {
      c.root.append(h("h3", {}, "Your cart"), h("ul", {}, ...cart.map((f) => h("li", {}, f))), h("button", { id: "checkout", class: "big", onclick: () => { c.state.checkedOut = cart.slice(); c.save(); c.finish(); } }, "Check out"), " ", h("a", { href: c.url("main") }, "Continue shopping"));
    }
    c.score = () => { const co = c.state.checkedOut; return co && co.length === 1 && co[0] === target ? 1 : 0; };
    c.plan = () => [{ op: "click", sel: "#add" + items.indexOf(target) }, { op: "click", sel: "#cart" }, { op: "click", sel: "#checkout" }];
  };

  T["compose-email"] = (c, R, h) => {
    const to = R.choice(NAMES).toLowerCase() + "@example.com", subject = phrase(R, 2);
    c.instruction = 'Write an email to "' + to + '" with the subject "' + subject + '" and send it.';
    if (c.view === "main") {
      c.root.append(h("div", { class: "row" }, h("a", { id: "compose", href: c.url("compose"), style: { fontSize: "18px" } }, "\u270E Compose")), h("div", { class: "box" }, h("b", {}, "Inbox"), ...R.sample(NAMES, 3).map((n) => h("div", {}, n + ": " + phrase(R, 3)))));
    } else {
      const t = h("input", { type: "text", id: "to" }), s = h("input", { type: "text", id: "subject" });
      c.root.append(h("h3", {}, "New message"), h("label", {}, "To ", t), h("label", {}, "Subject ", s), submit(h, () => { c.state.sent = [t.value, s.value]; c.save(); c.finish(); }, "Send"));
    }
    c.score = () => { const m = c.state.sent; return m && m[0].trim() === to && m[1].trim() === subject ? 1 : 0; };
    c.plan = () => [{ op: "click", sel: "#compose" }, { op: "click", sel: "#to" }, { op: "type", text: to }, { op: "click", sel: "#subject" }, { op: "type", text: subject }, { op: "click", sel: "#submit" }];
  };

  T["delete-confirm"] = (c, R, h) => {
    const items = R.sample(WORDS, 4).map((w) => w + ".doc");
    const target = R.choice(items);
    c.instruction = 'Delete "' + target + '" and confirm.';
    const alive = new Set(items);
    let confirmed = false;
    const list = h("div", { class: "box", style: { width: "300px" } });
    items.forEach((f, i) => {
      const row = h("div", { class: "row", style: { justifyContent: "space-between" } }, f, h("button", { id: "del" + i, onclick: () => {
        const m = h("div", { class: "modal", id: "modal" }, h("div", { class: "box" }, h("p", {}, 'Delete "' + f + '"?'), h("button", { id: "yes", onclick: () => { alive.delete(f); row.remove(); m.remove(); confirmed = true; c.finish(); } }, "Yes, delete"), " ", h("button", { id: "no", onclick: () => m.remove() }, "No")));
        document.body.append(m);
      } }, "Delete"));
      list.append(row);
    });
    c.root.append(list);
    c.score = () => (confirmed && !alive.has(target) && alive.size === items.length - 1 ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#del" + items.indexOf(target) }, { op: "click", sel: "#yes" }];
  };

  T["rename-file"] = (c, R, h) => {
    const files = R.sample(WORDS, 3).map((w) => w + ".txt");
    const target = R.choice(files), newName = R.choice(WORDS.filter((w) => !files.includes(w + ".txt"))) + ".txt";
    c.instruction = 'Rename "' + target + '" to "' + newName + '": double-click its name, type the new name and press Enter.';
    const names = files.slice();
    const list = h("div", { class: "box", style: { width: "300px" } });
    files.forEach((f, i) => {
      const span = h("div", { id: "f" + i, style: { padding: "6px" } }, f);
      span.addEventListener("dblclick", () => {
        const inp = h("input", { type: "text", id: "edit" + i, value: names[i] });
        inp.addEventListener("keydown", (e) => { if (e.key === "Enter") { names[i] = inp.value; span.textContent = inp.value; c.finish(); } });
        span.textContent = ""; span.append(inp); inp.focus(); inp.select();
      });
      list.append(span);
    });
    c.root.append(list);
    c.score = () => (names[files.indexOf(target)].trim() === newName && names.filter((n, i) => n === files[i]).length === files.length - 1 ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#f" + files.indexOf(target), count: 2 }, { op: "type", text: newName }, { op: "key", keys: ["enter"] }];
  };

  T["edit-profile"] = (c, R, h) => {
    const name = R.choice(NAMES), city = R.choice(["Oslo", "Lima", "Pune", "Kyoto", "Accra", "Perth"]);
    const oldCity = R.choice(["Rome", "Cairo", "Quito"]);
    c.instruction = 'Open your profile, click Edit, change the city to "' + city + '" and save.';
    if (c.view === "main") {
      c.root.append(h("div", { class: "nav" }, h("a", { href: "#" }, "Home"), h("a", { id: "profile", href: c.url("profile") }, "Profile"), h("a", { href: "#" }, "Help")), h("p", {}, "Hello, " + name + "!"));
    } else {
      const view = h("div", {}, h("p", {}, "Name: " + name), h("p", {}, "City: " + (c.state.city || oldCity)), h("button", { id: "edit", onclick: () => {
        const inp = h("input", { type: "text", id: "city", value: c.state.city || oldCity });
        view.replaceChildren(h("label", {}, "City ", inp), submit(h, () => { c.state.city = inp.value; c.save(); c.finish(); }, "Save"));
      } }, "Edit"));
      c.root.append(h("h3", {}, "Profile"), view);
    }
    c.score = () => ((c.state.city || "").trim() === city ? 1 : 0);
    c.plan = () => [{ op: "click", sel: "#profile" }, { op: "click", sel: "#edit" }, { op: "click", sel: "#city", count: 3 }, { op: "type", text: city }, { op: "click", sel: "#submit" }];
  };
})();
