// agentrl trajectory viewer: renders the JSON embedded in <script id="data"> with plain DOM calls.
// Model text is only ever inserted as textContent, never as HTML.
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("data").textContent);
  const T = DATA.trajectories;
  const app = document.getElementById("app");

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const kid of kids) if (kid != null) e.append(kid);
    return e;
  }
  const badge = (text, cls) => el("span", { class: "badge " + (cls || ""), text: text });
  const fmt = (x) => (typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(3)) : String(x));
  const uniq = (xs) => Array.from(new Set(xs)).sort();

  // ---------------------------------------------------------------- filters
  const envs = uniq(T.map((t) => t.env).filter(Boolean));
  const errors = uniq(T.flatMap((t) => t.errors));
  const fEnv = el("select", { id: "f-env" }, el("option", { value: "", text: "all envs" }), ...envs.map((e) => el("option", { value: e, text: e })));
  const fErr = el("select", { id: "f-error" }, el("option", { value: "", text: "any" }), el("option", { value: "__none", text: "no errors" }),
    ...errors.map((e) => el("option", { value: e, text: e })));
  const fMin = el("input", { id: "f-rmin", type: "number", step: "any", placeholder: "min", size: "5" });
  const fMax = el("input", { id: "f-rmax", type: "number", step: "any", placeholder: "max", size: "5" });
  const fText = el("input", { id: "f-text", type: "search", placeholder: "search text", size: "14" });
  const count = el("span", { id: "count", class: "badge" });
  const header = el("header", {}, el("h1", { text: DATA.title }),
    el("div", { class: "filters" },
      el("label", {}, "env ", fEnv), el("label", {}, "error ", fErr),
      el("label", {}, "reward ", fMin, " – ", fMax), fText, count));
  const list = el("div", { id: "list" });
  const detail = el("div", { id: "detail" }, el("div", { class: "empty", text: "Select a trajectory." }));
  app.append(header, el("main", {}, list, detail));

  function matches(t) {
    if (fEnv.value && t.env !== fEnv.value) return false;
    if (fErr.value === "__none" && t.errors.length) return false;
    if (fErr.value && fErr.value !== "__none" && !t.errors.includes(fErr.value)) return false;
    if (fMin.value !== "" && t.reward < Number(fMin.value)) return false;
    if (fMax.value !== "" && t.reward > Number(fMax.value)) return false;
    const q = fText.value.trim().toLowerCase();
    if (q && !JSON.stringify(t.turns).toLowerCase().includes(q) && !t.source.toLowerCase().includes(q)) return false;
    return true;
  }

  let selected = null;
  function renderList() {
    list.replaceChildren();
    const shown = T.filter(matches);
    count.textContent = shown.length + " / " + T.length;
    for (const t of shown) {
      const row = el("div", { class: "row" + (selected === t.id ? " sel" : ""), "data-id": String(t.id), onclick: () => select(t.id) },
        el("div", {}, el("div", { class: "src", text: t.source }),
          el("div", {}, badge((t.env || "env?") + (t.item ? " #" + t.item : "")), ...t.errors.map((e) => badge(e, "err")))),
        el("div", {}, badge("r=" + fmt(t.reward), t.reward > 0 ? "ok" : "")));
      list.append(row);
    }
    if (DATA.problems.length) {
      list.append(el("div", { class: "row" }, el("div", { class: "src", text: DATA.problems.length + " unreadable line(s): " +
        DATA.problems.map((p) => p.source + " (" + p.error + ")").join("; ") })));
    }
  }
  for (const f of [fEnv, fErr, fMin, fMax, fText]) f.addEventListener("input", renderList);

  // ---------------------------------------------------------------- detail
  function gapColor(g, maxGap) {
    const x = maxGap > 0 ? Math.min(1, g / maxGap) : 0;
    return "rgb(255," + Math.round(255 - 200 * x) + "," + Math.round(255 - 200 * x) + ")";
  }
  function strip(tokens, mode, maxGap) {
    const s = el("div", { class: "strip" + (mode === "gap" ? " gap" : "") });
    tokens.forEach((tk, i) => {
      const [text, kind, lp, gap] = tk;
      const span = el("span", { class: "tok " + kind, text: text });
      let tip = "#" + i + " " + (kind === "m" ? "model (mask 1)" : kind === "e" ? "env (mask 0)" : "prompt") + " logprob " + fmt(lp);
      if (gap != null) tip += " |rollout-train| " + gap.toExponential(2);
      span.title = tip;
      if (mode === "gap") {
        span.className = "tok";
        span.style.background = kind === "m" && gap != null ? gapColor(gap, maxGap) : "#f3f4f6";
      }
      s.append(span);
    });
    return s;
  }
  function message(m) {
    const head = el("div", {}, badge(m.role), m.channel ? badge(m.channel, "ch") : null,
      m.recipient ? badge("→ " + m.recipient, "to") : null, m.content_type ? badge(m.content_type) : null);
    return el("div", { class: "msg " + (m.channel || "") }, head, el("pre", { text: m.content }));
  }
  function tool(r) {
    const args = typeof r.arguments === "string" ? r.arguments : JSON.stringify(r.arguments, null, 1);
    return el("div", { class: "tool" + (r.error ? " failed" : "") },
      el("div", {}, badge("tool " + r.name, "to"), r.error ? badge(r.error, "err") : badge("ok", "ok"), badge(fmt(r.latency_s) + " s")),
      el("pre", { class: "args", text: "args: " + args }), el("pre", { class: "result", text: r.result }));
  }
  function select(id) {
    selected = id;
    const t = T[id];
    for (const r of list.children) r.classList.toggle("sel", r.dataset.id === String(id));
    const parts = [el("h2", { text: t.source }),
      el("div", { class: "summary" }, el("span", { text: "env " + (t.env || "?") }), el("span", { text: "reward " + fmt(t.reward) }),
        el("span", { text: t.terminated ? "terminated" : t.truncated ? "truncated" : "unfinished" }),
        el("span", { text: t.turns.length + " turns" }), el("span", { text: t.response.filter((x) => x[1] === "m").length + " model tokens" }),
        ...t.errors.map((e) => badge(e, "err")))];
    const task = t.metadata.task;
    if (task && typeof task === "object" && task.prompt != null) {
      parts.push(el("div", { class: "msg task" }, el("div", {}, badge("task" + (task.id != null ? " " + task.id : "")),
        task.answer != null ? badge("answer " + task.answer) : null), el("pre", { text: String(task.prompt) })));
    }
    if (Object.keys(t.reward_components).length) {
      parts.push(el("table", { class: "kv" }, ...Object.entries(t.reward_components).map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", { text: fmt(v) })))));
    }
    t.turns.forEach((turn, i) => {
      const box = el("div", { class: "turn" }, el("h3", { text: "turn " + (i + 1) + " · tokens " + turn.model_span.join("–") +
        (turn.parsed.stop_token == null ? " · no stop token" : "") }));
      for (const m of turn.parsed.messages) box.append(message(m));
      for (const e of turn.parsed.errors) box.append(el("div", { class: "tool failed" }, badge("parse: " + e.kind, "err"), el("pre", { text: e.message })));
      for (const r of turn.tools) box.append(tool(r));
      parts.push(box);
    });
    parts.push(el("h2", { text: "Tokens" }),
      el("div", { class: "legend" }, el("span", { class: "tok m", text: "model (mask 1)" }), el("span", { class: "tok e", text: "env (mask 0)" }),
        el("span", { class: "tok p", text: "prompt" })),
      el("details", {}, el("summary", { text: "prompt (" + t.prompt.length + " tokens)" }), strip(t.prompt, "mask")),
      strip(t.response, "mask"));
    if (t.has_gap) {
      parts.push(el("h2", { text: "Rollout vs train log-prob gap" }),
        el("div", { class: "legend", text: "white = 0, red = max |rollout − train| = " + (t.max_gap == null ? "n/a" : t.max_gap.toExponential(2)) +
          "; env tokens grey" }), strip(t.response, "gap", t.max_gap || 0));
    }
    parts.push(el("details", {}, el("summary", { text: "metadata" }), el("pre", { text: JSON.stringify(t.metadata, null, 1) })));
    detail.replaceChildren(...parts);
  }
  renderList();
})();
