/* ExGRPO pool dashboard: plain JavaScript, no dependencies. It reads the service's /v1 API with
 * the bearer token kept in localStorage (or anonymously), draws its charts as inline SVG, and
 * polls the selected run while it is active. Everything shown from the service is inserted as text
 * (never as HTML). */
"use strict";

(() => {
  // ------------------------------------------------------------------------------ settings
  const BASE = location.pathname.replace(/\/dashboard\/?$/, "");
  const TOKEN_KEY = "exgrpo.dashboard.token";
  const POLL_LIVE_MS = 2500;
  const POLL_IDLE_MS = 15000;
  const ACTIVE_MIN_MS = 120000; // a run updated within this window (or 3 step times) is "active"
  const PAGE_SIZE = 25;
  const SEARCH_SCAN_LIMIT = 5000; // questions scanned per search page before pausing
  const COLORS = ["#2f6fde", "#e8590c", "#1f9d55", "#9c36b5", "#c4372c", "#0b7285", "#a61e4d"];
  const W = 560;
  const H = 220;
  const M = { l: 48, r: 14, t: 12, b: 26 };

  const COMPARE_DEFAULTS = ["batch/solved", "loss/total"];
  const COMPARE_MAX = 12; // runs compared at once (the colours repeat after 7)

  const CHARTS = [
    {
      id: "solved", title: "Solved fraction and held-out accuracy", yMin: 0, yMax: 1,
      series: [
        { key: "batch/solved", label: "batch solved" },
        { key: "eval/accuracy", label: "held-out accuracy" },
      ],
    },
    { id: "buckets", title: "Eligible questions by bucket over time", kind: "stacked",
      empty: "no experience statistics yet" },
    { id: "bucket-now", title: "Bucket histogram now", kind: "histogram", empty: "no eligible questions yet" },
    {
      id: "experience", title: "Eligible and retired questions", yMin: 0,
      series: [
        { key: "experience/eligible", label: "eligible" },
        { key: "experience/retired", label: "retired" },
      ],
    },
    {
      id: "replay", title: "Replay share of the batch", yMin: 0, yMax: 1,
      series: [{ key: "experience/replay_share", label: "replay share" }],
    },
    {
      id: "is", title: "Importance weights of replayed tokens", yMin: 0, empty: "no replayed trajectories yet",
      series: [
        { key: "is/w_mean", label: "w mean" },
        { key: "is/w_max", label: "w max" },
        { key: "is/fw_mean", label: "f(w) mean" },
      ],
    },
    {
      id: "loss", title: "Loss",
      series: [{ key: "loss/total", label: "total loss" }],
    },
    {
      id: "entropy", title: "Mean token entropy of the policy", yMin: 0,
      series: [{ key: "actor/entropy", label: "entropy" }],
    },
    {
      id: "length", title: "Mean response length (tokens)", yMin: 0,
      series: [{ key: "response/length_mean", label: "length" }],
    },
    {
      id: "timing", title: "Step time (s)", yMin: 0,
      series: [
        { key: "timing/step", label: "step" },
        { key: "timing/generate", label: "generate" },
        { key: "timing/update", label: "update" },
      ],
    },
  ];

  // --------------------------------------------------------------------------------- state
  const state = {
    pools: [],
    pool: null,
    poolInfo: null,
    runs: [],
    run: null,
    runInfo: null,
    stats: null,
    metrics: new Map(), // step -> {metrics, updated_at}
    poolGen: 0,
    runGen: 0,
    pollTimer: null,
    polls: 0,
    active: false,
    skewMs: 0,
    errorSource: null,
    q: { mode: "list", query: "", pages: [], index: -1, gen: 0 },
    // runs of the pool compared side by side: names, each one's metrics (step -> {metrics,
    // updated_at}), the metric of each comparison chart, the smoothing weight
    cmp: { selected: new Set(), data: new Map(), charts: [...COMPARE_DEFAULTS], smoothing: 0, gen: 0, timer: null },
    question: null,
  };

  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c);
    return node;
  }

  function svg(tag, attrs, ...children) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "text") node.textContent = v;
      else node.setAttribute(k, String(v));
    }
    for (const c of children) if (c) node.append(c);
    return node;
  }

  // ---------------------------------------------------------------------------- formatting
  function fmt(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (typeof v !== "number") return String(v);
    const a = Math.abs(v);
    if (digits !== undefined) return v.toFixed(digits);
    if (Number.isInteger(v) && a < 1e7) return v.toLocaleString("en-US");
    if (a >= 1e6) return (v / 1e6).toFixed(2) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a >= 1) return v.toFixed(2);
    if (a === 0) return "0";
    if (a >= 0.001) return v.toFixed(3);
    return v.toExponential(1);
  }

  function fmtTick(v) {
    return Math.abs(v) >= 1e4 ? fmt(v) : String(Number(v.toPrecision(6)));
  }

  function ago(ms) {
    const s = Math.max(0, Math.round(ms / 1000));
    if (s < 60) return `${s} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
    return `${(s / 86400).toFixed(1)} d ago`;
  }

  const serverNow = () => Date.now() + state.skewMs;

  function localTime(iso) {
    const d = new Date(iso);
    return Number.isNaN(d.getTime()) ? iso : d.toLocaleString();
  }

  // ----------------------------------------------------------------------------------- API
  class ApiError extends Error {
    constructor(status, problem, method, path) {
      super(problem.detail || problem.title);
      this.status = status;
      this.problem = problem;
      this.method = method;
      this.path = path;
    }
  }

  function token() {
    try {
      return localStorage.getItem(TOKEN_KEY) || "";
    } catch {
      return "";
    }
  }

  async function api(path, options) {
    const opts = options || {};
    const method = opts.method || "GET";
    const headers = { Accept: "application/json, application/problem+json" };
    const t = token();
    if (t) headers.Authorization = `Bearer ${t}`;
    let body;
    if (opts.body !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(opts.body);
    }
    let res;
    try {
      res = await fetch(BASE + path, { method, headers, body, cache: "no-store", credentials: "omit" });
    } catch (e) {
      throw new ApiError(0, {
        title: "Service unreachable",
        detail: `no answer from ${location.origin}${BASE} (${e.message}); is the pool service running?`,
      }, method, path);
    }
    const date = res.headers.get("Date");
    if (date) {
      const server = Date.parse(date);
      if (!Number.isNaN(server)) state.skewMs = server - Date.now();
    }
    const text = await res.text();
    let data = null;
    if (text) {
      try {
        data = JSON.parse(text);
      } catch {
        data = null;
      }
    }
    if (!res.ok) {
      const p = data && typeof data === "object" ? data : {};
      throw new ApiError(res.status, {
        title: p.title || `HTTP ${res.status}`,
        detail: p.detail || (text ? text.slice(0, 300) : res.statusText),
        request_id: p.request_id || res.headers.get("X-Request-ID"),
      }, method, path);
    }
    return data;
  }

  const enc = encodeURIComponent;
  const poolPath = () => `/v1/pools/${enc(state.pool)}`;
  const runPath = () => `${poolPath()}/runs/${enc(state.run)}`;

  // -------------------------------------------------------------------------------- errors
  function showError(err, source) {
    const p = err instanceof ApiError ? err.problem : { title: "Error", detail: String(err && err.message || err) };
    $("error-title").textContent = p.title + (err.status ? ` (${err.status})` : "") + ":";
    let detail = p.detail || "";
    if (err.status === 401) detail += " — enter a bearer token at the top right.";
    $("error-detail").textContent = detail;
    const meta = [];
    if (err.method) meta.push(`${err.method} ${err.path}`);
    if (p.request_id) meta.push(`request ${p.request_id}`);
    $("error-meta").textContent = meta.length ? `(${meta.join(" · ")})` : "";
    const banner = $("error-banner");
    banner.dataset.status = String(err.status || 0);
    banner.hidden = false;
    state.errorSource = source || "other";
  }

  function clearError(source) {
    if (!source || state.errorSource === source) {
      $("error-banner").hidden = true;
      state.errorSource = null;
    }
  }

  /** Runs fn, showing its error in the banner: its result (true for none), or undefined if it failed. */
  async function guarded(source, fn) {
    try {
      const out = await fn();
      clearError(source);
      return out === undefined ? true : out;
    } catch (e) {
      showError(e, source);
      return undefined;
    }
  }

  // ---------------------------------------------------------------------------------- hash
  function readHash() {
    const p = new URLSearchParams(location.hash.replace(/^#/, ""));
    const q = p.get("q");
    const cmp = p.get("cmp");
    return {
      pool: p.get("pool"), run: p.get("run"), q: q && /^\d+$/.test(q) ? Number(q) : null,
      cmp: cmp === null ? null : cmp.split(",").filter(Boolean),
    };
  }

  function writeHash() {
    const p = new URLSearchParams();
    if (state.pool) p.set("pool", state.pool);
    if (state.pool && state.run) p.set("run", state.run);
    if (state.pool && state.question) p.set("q", String(state.question.id));
    if (state.pool && state.cmp.explicit) p.set("cmp", [...state.cmp.selected].join(","));
    const h = p.toString();
    if (location.hash.replace(/^#/, "") !== h) history.replaceState(null, "", h ? `#${h}` : location.pathname);
  }

  async function applyHash() {
    const h = readHash();
    if (h.pool && h.pool !== state.pool) await selectPool(h.pool, { run: h.run, q: h.q, cmp: h.cmp });
    else if (h.pool) {
      if (h.run && h.run !== state.run) await selectRun(h.run);
      if (h.q !== null && (!state.question || state.question.id !== h.q)) await openQuestion(h.q);
    }
  }

  // --------------------------------------------------------------------------------- pools
  async function loadPools() {
    const data = await api("/v1/pools");
    state.pools = data.data;
    renderPools();
  }

  function renderPools() {
    const list = $("pools-list");
    list.replaceChildren(
      ...state.pools.map((p) =>
        el("li", {
          "data-testid": "pool-item", "data-pool": p.name, class: p.name === state.pool ? "selected" : "",
          title: p.description || p.name, onclick: () => selectPool(p.name),
        },
        el("span", { class: "name", text: p.name }),
        el("span", { class: "meta", text: `${fmt(p.num_questions)} q · ${fmt(p.num_trajectories)} traj` })),
      ),
    );
    $("pools-empty").hidden = state.pools.length > 0;
  }

  async function selectPool(name, then) {
    const gen = ++state.poolGen;
    stopRun();
    state.pool = name;
    state.poolInfo = null;
    state.runs = [];
    state.question = null;
    resetCompare(then && then.cmp);
    writeHash();
    renderPools();
    $("welcome").hidden = true;
    $("pool-panel").hidden = false;
    $("browser-panel").hidden = false;
    $("question-detail").hidden = true;
    $("pool-title").textContent = `Pool ${name}`;
    $("runs-list").replaceChildren();
    $("runs-empty").textContent = "Loading runs…";
    $("runs-empty").hidden = false;
    const ok = await guarded("pool", async () => {
      const [info, runs] = await Promise.all([api(poolPath()), api(`${poolPath()}/runs`)]);
      if (gen !== state.poolGen) return;
      state.poolInfo = info;
      state.runs = runs.data;
      renderPool();
      renderRuns();
    });
    if (gen === state.poolGen && state.poolInfo) startCompare(); // loads beside the run and the questions
    if (gen !== state.poolGen) return;
    if (ok === undefined && !state.poolInfo) {
      $("runs-empty").textContent = "Could not load this pool.";
      return;
    }
    const wanted = then && then.run;
    if (wanted && state.runs.some((r) => r.name === wanted)) await selectRun(wanted);
    else if (state.runs.length === 1 && !(then && then.q !== null && then.q !== undefined)) {
      await selectRun(state.runs[0].name);
    }
    if (gen !== state.poolGen) return;
    await listQuestions();
    if (then && then.q !== null && then.q !== undefined) await openQuestion(then.q);
  }

  function renderPool() {
    const p = state.poolInfo;
    if (!p) return;
    $("pool-description").textContent = p.description || "";
    $("pool-cards").replaceChildren(
      card("questions", fmt(p.num_questions), "pool-questions"),
      card("trajectories", fmt(p.num_trajectories), "pool-trajectories"),
      card("runs", fmt(p.num_runs), "pool-runs"),
      card("K", fmt(p.config.k), "pool-k"),
      card("batch size B", fmt(p.config.batch_size), "pool-b"),
    );
    const c = p.config;
    $("pool-config").textContent =
      `weighting ${c.weighting} · experience ratio ${c.experience_ratio} · start threshold ${c.start_threshold} · ` +
      `collect ${c.lbound} < correct ≤ ${c.rbound === null ? c.k - 1 : c.rbound} · sharing ${c.sharing}`;
  }

  function card(label, value, testid, extraClass) {
    return el("div", { class: "card" },
      el("div", { class: "k", text: label }),
      el("div", { class: `v ${extraClass || ""}`, "data-testid": `stat-${testid}`, text: value }));
  }

  // ---------------------------------------------------------------------------------- runs
  async function loadRuns() {
    const runs = await api(`${poolPath()}/runs`);
    state.runs = runs.data;
    renderRuns();
  }

  function renderRuns() {
    $("runs-list").replaceChildren(
      ...state.runs.map((r) =>
        el("li", {
          "data-testid": "run-item", "data-run": r.name, class: r.name === state.run ? "selected" : "",
          onclick: () => selectRun(r.name),
        },
        el("span", { class: "name", text: r.name }),
        el("span", { class: "meta" },
          el("span", { class: `badge ${r.phase === "mixed" ? "mixed" : ""}`, text: r.phase.replace("_", "-") }),
          ` step ${r.step}`)),
      ),
    );
    $("runs-empty").textContent = state.pool ? "No runs in this pool yet." : "Select a pool.";
    $("runs-empty").hidden = state.runs.length > 0;
    renderRunsTable();
  }

  function stopRun() {
    clearTimeout(state.pollTimer);
    state.pollTimer = null;
    state.runGen++;
    state.run = null;
    state.runInfo = null;
    state.stats = null;
    state.metrics = new Map();
    state.active = false;
    $("run-panel").hidden = true;
    setLive("off", "not watching");
  }

  async function selectRun(name) {
    stopRun();
    const gen = state.runGen;
    state.run = name;
    writeHash();
    renderRuns();
    $("run-panel").hidden = false;
    $("run-title").textContent = name;
    $("run-cards").replaceChildren();
    buildCharts();
    setLive("off", "loading…");
    const ok = await guarded("run", () => refreshRun(gen, true));
    if (gen !== state.runGen) return;
    if (ok === undefined) setLive("error", "could not load the run");
    if (state.q.mode === "eligible") listEligible();
    schedulePoll(state.active ? POLL_LIVE_MS : POLL_IDLE_MS);
    return true;
  }

  async function fetchMetrics(after, run) {
    const path = run === undefined ? runPath() : `${poolPath()}/runs/${enc(run)}`;
    const out = [];
    let cursor = after;
    for (;;) {
      const page = await api(`${path}/metrics?after_step=${cursor}&limit=1000`);
      out.push(...page.data);
      if (page.count < 1000 || !page.data.length) break;
      cursor = page.data[page.data.length - 1].step;
    }
    return out;
  }

  /** Loads the run, its stats and its metrics (all of them, or only the last few steps: a step's
   * numbers arrive in more than one post, so the tail is fetched again every time). */
  async function refreshRun(gen, full) {
    const steps = [...state.metrics.keys()];
    const last = steps.length ? Math.max(...steps) : -1;
    const after = full ? -1 : Math.max(-1, last - 3);
    const [run, stats, rows] = await Promise.all([
      api(runPath()), api(`${runPath()}/stats`), fetchMetrics(after),
    ]);
    if (gen !== state.runGen) return false;
    let changed = full || !state.stats || JSON.stringify(stats) !== JSON.stringify(state.stats);
    for (const row of rows) {
      const prev = state.metrics.get(row.step);
      if (!prev || prev.updated_at !== row.updated_at) {
        state.metrics.set(row.step, { metrics: row.metrics, updated_at: row.updated_at });
        changed = true;
      }
    }
    state.runInfo = run;
    state.stats = stats;
    state.active = isActive();
    renderRunCards();
    if (changed) renderCharts();
    updateLive();
    return true;
  }

  function lastUpdateMs() {
    let t = state.runInfo ? Date.parse(state.runInfo.updated_at) : 0;
    for (const v of state.metrics.values()) t = Math.max(t, Date.parse(v.updated_at) || 0);
    return t;
  }

  function isActive() {
    const steps = [...state.metrics.keys()];
    let window = ACTIVE_MIN_MS;
    if (steps.length) {
      const m = state.metrics.get(Math.max(...steps)).metrics;
      if (typeof m["timing/step"] === "number") window = Math.max(window, 3000 * m["timing/step"]);
    }
    return serverNow() - lastUpdateMs() < window;
  }

  function setLive(mode, text) {
    const box = $("live-indicator");
    box.dataset.state = mode;
    $("live-text").textContent = text;
  }

  function updateLive() {
    if (!state.run) return setLive("off", "not watching");
    const since = ago(serverNow() - lastUpdateMs());
    if (!$("live-toggle").checked) return setLive("paused", `paused · updated ${since}`);
    if (state.active) return setLive("live", `live · step ${state.runInfo ? state.runInfo.step : "?"} · ${since}`);
    return setLive("idle", `idle · last update ${since}`);
  }

  function schedulePoll(ms) {
    clearTimeout(state.pollTimer);
    state.pollTimer = setTimeout(poll, ms);
  }

  async function poll() {
    const gen = state.runGen;
    if (!state.run) return;
    if (!$("live-toggle").checked) {
      updateLive();
      return;
    }
    state.polls++;
    try {
      await refreshRun(gen, false);
      if (gen !== state.runGen) return;
      if (state.polls % 4 === 0) {
        const [info] = await Promise.all([api(poolPath()), loadRuns()]);
        if (gen !== state.runGen) return;
        state.poolInfo = info;
        renderPool();
      }
      clearError("poll");
    } catch (e) {
      if (gen !== state.runGen) return;
      showError(e, "poll");
      setLive("error", "update failed; retrying");
    }
    if (gen !== state.runGen) return;
    const slow = document.hidden || !state.active;
    schedulePoll(slow ? POLL_IDLE_MS : POLL_LIVE_MS);
  }

  function renderRunCards() {
    const r = state.runInfo;
    const s = state.stats;
    if (!r || !s) return;
    $("run-cards").replaceChildren(
      card("phase", r.phase.replace("_", "-"), "phase", r.phase === "mixed" ? "phase-mixed" : ""),
      card("switched at step", r.switched_at_step === null ? "–" : fmt(r.switched_at_step), "switched"),
      card("step", fmt(s.step), "step"),
      card("policy version", fmt(s.policy_version), "policy-version"),
      card("eligible", fmt(s.eligible), "eligible"),
      card("retired", fmt(s.retired), "retired"),
      card("seen", fmt(s.seen), "seen"),
      card("trajectories", fmt(s.trajectories), "trajectories"),
      card("replayed last step", fmt(s.replayed_last_step), "replayed"),
      card("ingested / min", fmt(s.ingest_per_minute, 1), "ingest"),
      card("epoch", fmt(r.epoch), "epoch"),
    );
  }

  // ------------------------------------------------------------------------- compare runs
  function runColor(name) {
    const i = state.runs.findIndex((r) => r.name === name);
    return COLORS[Math.max(0, i) % COLORS.length];
  }

  /** The compared runs in the order of the runs table (their colours follow it). */
  function comparedRuns() {
    return state.runs.map((r) => r.name).filter((n) => state.cmp.selected.has(n) && state.cmp.data.has(n));
  }

  function resetCompare(wanted) {
    const old = state.cmp;
    clearTimeout(old.timer);
    state.cmp = {
      selected: new Set(wanted || []), data: new Map(), charts: old.charts, smoothing: old.smoothing,
      gen: old.gen + 1, timer: null, explicit: Array.isArray(wanted),
    };
    $("compare-panel").hidden = true;
  }

  /** Every run of the pool is compared unless the link or the user chose some. */
  function defaultSelection() {
    const c = state.cmp;
    const names = state.runs.map((r) => r.name);
    c.selected = c.explicit
      ? new Set([...c.selected].filter((n) => names.includes(n)))
      : new Set(names.slice(0, COMPARE_MAX));
  }

  async function startCompare() {
    defaultSelection();
    $("compare-panel").hidden = state.runs.length === 0;
    renderRunsTable();
    buildCompareCharts();
    if (state.runs.length) await loadCompare(true);
    scheduleCompare();
  }

  function renderRunsTable() {
    const pc = state.poolInfo ? state.poolInfo.config : {};
    const own = (v, pool) => (v === null || v === undefined ? `${fmt(pool)} (pool)` : fmt(v));
    $("runs-table-body").replaceChildren(
      ...state.runs.map((r) => {
        const on = state.cmp.selected.has(r.name);
        const sw = el("span", { class: "swatch" });
        sw.style.setProperty("--c", runColor(r.name));
        const o = r.overrides || {};
        return el("tr", { "data-testid": "run-row", "data-run": r.name, class: on ? "selected" : "" },
          el("td", {}, el("input", {
            type: "checkbox", checked: on, "data-testid": "compare-toggle", "data-run": r.name,
            title: `compare ${r.name}`, onchange: (ev) => toggleCompare(r.name, ev.target.checked),
          })),
          el("td", {}, sw, el("button", { type: "button", class: "link", text: r.name, title: "open this run",
            onclick: () => selectRun(r.name) })),
          el("td", {}, el("span", { class: `badge ${r.phase === "mixed" ? "mixed" : ""}`, text: r.phase.replace("_", "-") })),
          el("td", { "data-col": "step", text: fmt(r.step) }),
          el("td", { "data-col": "policy-version", text: fmt(r.policy_version) }),
          el("td", { "data-col": "epoch", text: fmt(r.epoch) }),
          el("td", { "data-col": "seed", text: String(r.seed) }),
          el("td", { "data-col": "experience", text: o.experience === false ? "off (GRPO)" : "on" }),
          el("td", { "data-col": "ratio", text: own(o.experience_ratio, pc.experience_ratio) }),
          el("td", { "data-col": "batch-size", text: own(o.batch_size, pc.batch_size) }),
          el("td", { "data-col": "threshold", text: own(o.start_threshold, pc.start_threshold) }),
          el("td", { class: "muted", text: localTime(r.created_at) }),
          el("td", { class: "muted", title: localTime(r.updated_at), text: ago(serverNow() - Date.parse(r.updated_at)) }));
      }),
    );
  }

  async function toggleCompare(name, on) {
    const c = state.cmp;
    if (on) c.selected.add(name);
    else c.selected.delete(name);
    c.explicit = true;
    writeHash();
    renderRunsTable();
    await loadCompare(false);
  }

  /** The metrics of every compared run: all of them, or the last few steps again (a step's
   * numbers arrive in more than one post) plus everything of a run not loaded yet. */
  async function loadCompare(full) {
    const c = state.cmp;
    const gen = c.gen;
    const names = [...c.selected];
    const ok = await guarded("compare", async () => {
      const pages = await Promise.all(names.map((name) => {
        const have = full ? null : c.data.get(name);
        const steps = have ? [...have.keys()] : [];
        return fetchMetrics(steps.length ? Math.max(-1, Math.max(...steps) - 3) : -1, name);
      }));
      if (gen !== state.cmp.gen) return;
      names.forEach((name, i) => {
        const rows = (!full && c.data.get(name)) || new Map();
        for (const row of pages[i]) rows.set(row.step, { metrics: row.metrics, updated_at: row.updated_at });
        c.data.set(name, rows);
      });
    });
    if (gen !== state.cmp.gen) return;
    renderCompare();
    if (ok !== undefined) {
      const steps = comparedRuns().reduce((a, n) => a + c.data.get(n).size, 0);
      $("compare-status").textContent = `${c.selected.size} of ${state.runs.length} runs compared · ${fmt(steps)} steps`;
    }
  }

  function comparePollMs() {
    const now = serverNow();
    const active = state.runs.some((r) => state.cmp.selected.has(r.name) && now - Date.parse(r.updated_at) < ACTIVE_MIN_MS);
    return active ? POLL_LIVE_MS : POLL_IDLE_MS;
  }

  function scheduleCompare() {
    const gen = state.cmp.gen;
    clearTimeout(state.cmp.timer);
    state.cmp.timer = setTimeout(async () => {
      if (gen !== state.cmp.gen) return;
      if ($("live-toggle").checked && !document.hidden && state.runs.length) {
        const before = state.runs.map((r) => r.name).join("\n");
        await guarded("compare", loadRuns);
        if (gen !== state.cmp.gen) return;
        if (state.runs.map((r) => r.name).join("\n") !== before) {
          defaultSelection();
          renderRunsTable();
        }
        await loadCompare(false);
      }
      if (gen === state.cmp.gen) scheduleCompare();
    }, comparePollMs());
  }

  /** Every metric stored for a compared run. */
  function compareKeys() {
    const keys = new Set();
    for (const name of comparedRuns()) {
      for (const v of state.cmp.data.get(name).values()) for (const k of Object.keys(v.metrics)) keys.add(k);
    }
    return [...keys].sort();
  }

  function buildCompareCharts() {
    $("compare-charts").replaceChildren(...state.cmp.charts.map((_, i) => {
      const select = el("select", {
        "data-testid": "compare-metric", "aria-label": "metric",
        onchange: (ev) => { state.cmp.charts[i] = ev.target.value; renderCompare(); },
      });
      const remove = el("button", {
        type: "button", class: "link", text: "remove", "data-testid": "compare-remove",
        onclick: () => { state.cmp.charts.splice(i, 1); buildCompareCharts(); renderCompare(); },
      });
      return el("figure", { class: "chart", "data-testid": "compare-chart", "data-chart": i, "data-points": "0" },
        el("figcaption", {}, select, el("span", {}, el("span", { class: "muted", "data-role": "latest" }), remove)),
        el("div", { class: "plot" }),
        el("div", { class: "legend" }),
        el("div", { class: "chart-empty", text: "no values of this metric in the compared runs" }));
    }));
  }

  function addCompareChart() {
    const keys = compareKeys();
    const free = keys.find((k) => !state.cmp.charts.includes(k));
    state.cmp.charts.push(free || keys[0] || COMPARE_DEFAULTS[0]);
    buildCompareCharts();
    renderCompare();
  }

  function fillMetricSelect(select, keys, current) {
    const all = keys.includes(current) ? keys : [...keys, current].sort();
    const sig = all.join("\n");
    if (select.dataset.keys !== sig) {
      const groups = new Map();
      for (const k of all) {
        const g = k.includes("/") ? k.slice(0, k.indexOf("/")) : "other";
        if (!groups.has(g)) groups.set(g, []);
        groups.get(g).push(k);
      }
      select.replaceChildren(...[...groups].map(([g, ks]) =>
        el("optgroup", { label: g }, ...ks.map((k) => el("option", { value: k, text: k })))));
      select.dataset.keys = sig;
    }
    select.value = current;
  }

  function renderCompare() {
    const keys = compareKeys();
    $("compare-empty").hidden = state.cmp.selected.size > 0;
    for (const fig of $("compare-charts").children) {
      const key = state.cmp.charts[Number(fig.dataset.chart)];
      fillMetricSelect(fig.querySelector("select"), keys, key);
      renderCompareChart(fig, key);
    }
  }

  /** Exponential moving average with the start-up bias removed (as TensorBoard smooths). */
  function smooth(pts, w) {
    if (!(w > 0)) return pts;
    let acc = 0;
    return pts.map((p, i) => {
      acc = acc * w + (1 - w) * p[1];
      return [p[0], acc / (1 - Math.pow(w, i + 1))];
    });
  }

  function renderCompareChart(fig, key) {
    const c = state.cmp;
    const series = comparedRuns().map((name) => {
      const rows = c.data.get(name);
      const raw = [...rows.keys()].sort((a, b) => a - b)
        .map((step) => [step, rows.get(step).metrics[key]])
        .filter((p) => typeof p[1] === "number" && Number.isFinite(p[1]));
      return { name, color: runColor(name), raw, pts: smooth(raw, c.smoothing) };
    });
    const all = series.flatMap((s) => s.raw);
    fig.dataset.metric = key;
    legend(fig, series.map((s) => ({ label: `${s.name}${s.raw.length ? "" : " (none)"}`, color: s.color })));
    const { plot, latest } = chartBody(fig, !all.length);
    if (!all.length) return;
    const xs = all.map((p) => p[0]);
    const [lo, hi] = yDomain([...all.map((p) => p[1]), ...series.flatMap((s) => s.pts.map((p) => p[1]))], {});
    const f = frame(xs, lo, hi);
    const line = (pts) => pathD(f, pts);
    for (const s of series) {
      if (!s.raw.length) continue;
      if (c.smoothing > 0) {
        f.root.append(svg("path", { d: line(s.raw), fill: "none", stroke: s.color, "stroke-width": 1.2, class: "series-raw" }));
      }
      const last = s.pts[s.pts.length - 1][1];
      f.root.append(svg("path", {
        d: line(s.pts), fill: "none", stroke: s.color, "stroke-width": 1.8, "stroke-linejoin": "round", class: "series",
        "data-run": s.name, "data-metric": key, "data-points": s.pts.length, "data-smoothing": c.smoothing,
        "data-last": String(last),
      }));
    }
    latest.textContent = series.filter((s) => s.pts.length)
      .map((s) => `${s.name} ${fmt(s.pts[s.pts.length - 1][1])}`).join(" · ");
    hover(f, [...new Set(xs)].sort((a, b) => a - b), (step) =>
      series.map((s) => {
        const i = s.raw.findIndex((q) => q[0] === step);
        return { label: s.name, color: s.color, value: i < 0 ? "–" : fmt(s.pts[i][1]) };
      }));
    plot.replaceChildren(f.root);
    setEmpty(fig, false, all.length);
  }

  function csvCell(v) {
    const s = String(v);
    return /[",\r\n]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s;
  }

  /** Every stored metric of the compared runs: one row per run and step (raw values, not smoothed). */
  function compareCsv() {
    const keys = compareKeys();
    const lines = [["run", "step", ...keys].map(csvCell).join(",")];
    for (const name of comparedRuns()) {
      const rows = state.cmp.data.get(name);
      for (const step of [...rows.keys()].sort((a, b) => a - b)) {
        const m = rows.get(step).metrics;
        lines.push([name, step, ...keys.map((k) => (typeof m[k] === "number" ? m[k] : ""))].map(csvCell).join(","));
      }
    }
    return `${lines.join("\n")}\n`;
  }

  function exportCsv() {
    if (!comparedRuns().length) {
      showError(new Error("tick at least one run in the table to export its metrics"), "compare");
      return;
    }
    const url = URL.createObjectURL(new Blob([compareCsv()], { type: "text/csv" }));
    const link = el("a", { href: url, download: `${state.pool}-runs.csv`, hidden: true });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }

  // -------------------------------------------------------------------------------- charts
  function buildCharts() {
    const box = $("charts");
    box.replaceChildren(
      ...CHARTS.map((c) => {
        const fig = el("figure", { class: "chart", id: `chart-${c.id}`, "data-testid": `chart-${c.id}`, "data-points": "0" },
          el("figcaption", {}, el("span", { text: c.title }), el("span", { class: "muted", "data-role": "latest" })),
          el("div", { class: "plot" }),
          el("div", { class: "legend" }),
          el("div", { class: "chart-empty", id: `chart-${c.id}-empty`, "data-testid": `chart-${c.id}-empty`, text: c.empty || "no metrics yet" }));
        return fig;
      }),
    );
  }

  function renderCharts() {
    const steps = [...state.metrics.keys()].sort((a, b) => a - b);
    $("metrics-empty").hidden = steps.length > 0;
    for (const c of CHARTS) {
      const fig = $(`chart-${c.id}`);
      if (!fig) continue;
      if (c.kind === "stacked") renderStacked(fig, steps);
      else if (c.kind === "histogram") renderHistogram(fig);
      else renderLines(fig, c, steps);
    }
  }

  function niceStep(span, target) {
    const raw = span / Math.max(1, target);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const r = raw / mag;
    return (r >= 5 ? 10 : r >= 2 ? 5 : r >= 1 ? 2 : 1) * mag;
  }

  function ticks(lo, hi, target, integer) {
    if (hi <= lo) return [lo];
    let step = niceStep(hi - lo, target);
    if (integer) step = Math.max(1, Math.round(step));
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toFixed(10)));
    return out;
  }

  function yDomain(values, c) {
    let lo = c.yMin !== undefined ? c.yMin : Math.min(...values);
    let hi = c.yMax !== undefined ? Math.max(c.yMax, ...values) : Math.max(...values);
    if (c.yMin !== undefined) lo = Math.min(lo, ...values);
    if (!(hi > lo)) {
      const pad = Math.abs(hi) > 0 ? Math.abs(hi) * 0.1 : 1;
      lo -= c.yMin !== undefined && lo >= c.yMin ? 0 : pad;
      hi += pad;
    } else if (c.yMax === undefined) {
      hi += (hi - lo) * 0.06;
    }
    return [lo, hi];
  }

  /** The frame of a chart: scales, grid, axes. Returns the svg and the scale functions. */
  function frame(xs, yLo, yHi, xLabels, bars) {
    const lo = Math.min(...xs);
    const hi = Math.max(...xs);
    let xLo = hi > lo ? lo : lo - 1;
    let xHi = hi > lo ? hi : hi + 1;
    if (bars) {
      xLo = lo - 0.5;
      xHi = hi + 0.5;
    }
    const pw = W - M.l - M.r;
    const ph = H - M.t - M.b;
    const sx = (x) => M.l + ((x - xLo) / (xHi - xLo)) * pw;
    const sy = (y) => M.t + ph - ((y - yLo) / (yHi - yLo)) * ph;
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
    const grid = svg("g", { class: "grid" });
    const axis = svg("g", { class: "axis" });
    for (const t of ticks(yLo, yHi, 5, false)) {
      grid.append(svg("line", { x1: M.l, x2: W - M.r, y1: sy(t), y2: sy(t) }));
      axis.append(svg("text", { x: M.l - 6, y: sy(t) + 3, "text-anchor": "end", text: fmtTick(t) }));
    }
    const xt = xLabels ? xs : ticks(xLo, xHi, 7, true).filter((t) => t >= lo - 1e-9 && t <= hi + 1e-9);
    for (const t of xt.length ? xt : [lo]) {
      axis.append(svg("text", { x: sx(t), y: H - 8, "text-anchor": "middle", text: xLabels ? xLabels(t) : fmt(t) }));
    }
    axis.append(svg("line", { x1: M.l, x2: W - M.r, y1: M.t + ph, y2: M.t + ph }));
    root.append(grid, axis);
    return { root, sx, sy, pw, ph };
  }

  function legend(fig, items, area) {
    fig.querySelector(".legend").replaceChildren(
      ...items.map((it) => {
        const s = el("span", { class: area ? "area" : "", text: it.label });
        s.style.setProperty("--c", it.color);
        return s;
      }),
    );
  }

  function setEmpty(fig, empty, points) {
    fig.dataset.points = String(points);
    fig.querySelector(".chart-empty").hidden = !empty;
  }

  /** A chart's plot and caption; with nothing to draw, an empty frame and the chart's notice. */
  function chartBody(fig, empty) {
    const plot = fig.querySelector(".plot");
    const latest = fig.querySelector("[data-role=latest]");
    if (empty) {
      plot.replaceChildren(frame([0, 1], 0, 1).root);
      latest.textContent = "";
      setEmpty(fig, true, 0);
    }
    return { plot, latest };
  }

  /** The svg path of a line through [step, value] points. */
  function pathD(f, pts) {
    return pts.map((p, i) => `${i ? "L" : "M"}${f.sx(p[0]).toFixed(1)},${f.sy(p[1]).toFixed(1)}`).join("");
  }

  function renderLines(fig, c, steps) {
    const series = c.series.map((s, i) => {
      const pts = [];
      for (const step of steps) {
        const v = state.metrics.get(step).metrics[s.key];
        if (typeof v === "number" && Number.isFinite(v)) pts.push([step, v]);
      }
      return { ...s, color: COLORS[i % COLORS.length], pts };
    });
    const all = series.flatMap((s) => s.pts);
    legend(fig, series.map((s) => ({ label: `${s.label}${s.pts.length ? "" : " (none)"}`, color: s.color })));
    const { plot, latest } = chartBody(fig, !all.length);
    if (!all.length) return;
    const xs = all.map((p) => p[0]);
    const [lo, hi] = yDomain(all.map((p) => p[1]), c);
    const f = frame(xs, lo, hi);
    for (const s of series) {
      if (!s.pts.length) continue;
      const d = pathD(f, s.pts);
      f.root.append(svg("path", {
        d, fill: "none", stroke: s.color, "stroke-width": 1.8, "stroke-linejoin": "round",
        "data-series": s.key, "data-points": s.pts.length, class: "series",
      }));
      if (s.pts.length <= 150) {
        const g = svg("g", { "data-series-points": s.key });
        for (const p of s.pts) {
          g.append(svg("circle", { cx: f.sx(p[0]).toFixed(1), cy: f.sy(p[1]).toFixed(1), r: 2.6, fill: s.color, class: "point" }));
        }
        f.root.append(g);
      }
    }
    const last = series.filter((s) => s.pts.length).map((s) => `${s.label} ${fmt(s.pts[s.pts.length - 1][1])}`);
    latest.textContent = last.join(" · ");
    hover(f, [...new Set(xs)].sort((a, b) => a - b), (step) =>
      series.map((s) => {
        const p = s.pts.find((q) => q[0] === step);
        return { label: s.label, color: s.color, value: p ? fmt(p[1]) : "–" };
      }));
    plot.replaceChildren(f.root);
    setEmpty(fig, false, all.length);
  }

  function bucketColor(k, kMax) {
    const t = kMax <= 1 ? 0.5 : (k - 1) / Math.max(1, kMax - 2);
    const hue = 8 + Math.max(0, Math.min(1, t)) * 200; // hard (few correct) red ... easy blue
    return `hsl(${hue.toFixed(0)}, 62%, 52%)`;
  }

  function renderStacked(fig, steps) {
    const K = state.poolInfo ? state.poolInfo.config.k : 8;
    const buckets = new Set();
    const rows = [];
    for (const step of steps) {
      const m = state.metrics.get(step).metrics;
      let has = typeof m["experience/eligible"] === "number";
      const vals = {};
      for (const [key, v] of Object.entries(m)) {
        const hit = /^experience\/bucket_(\d+)$/.exec(key);
        if (hit && typeof v === "number") {
          buckets.add(Number(hit[1]));
          vals[Number(hit[1])] = v;
          has = true;
        }
      }
      if (has) rows.push({ step, vals });
    }
    const ks = [...buckets].sort((a, b) => a - b);
    const plot = fig.querySelector(".plot");
    const latest = fig.querySelector("[data-role=latest]");
    const colors = Object.fromEntries(ks.map((k) => [k, bucketColor(k, K)]));
    legend(fig, ks.map((k) => ({ label: `${k}/${K} correct`, color: colors[k] })), true);
    if (!rows.length) {
      plot.replaceChildren(frame([0, 1], 0, 1).root);
      latest.textContent = "";
      setEmpty(fig, true, 0);
      return;
    }
    const totals = rows.map((r) => ks.reduce((a, k) => a + (r.vals[k] || 0), 0));
    const bars = rows.length <= 40;
    const f = frame(rows.map((r) => r.step), 0, Math.max(1, ...totals) * 1.06, null, bars);
    let drawn = 0;
    if (bars) {
      const slot = f.pw / Math.max(rows.length, rows[rows.length - 1].step - rows[0].step + 1);
      const bw = Math.max(2, Math.min(28, slot * 0.7));
      for (const k of ks) {
        const g = svg("g", { "data-bucket": k, fill: colors[k] });
        for (const r of rows) {
          const below = ks.filter((j) => j < k).reduce((a, j) => a + (r.vals[j] || 0), 0);
          const v = r.vals[k] || 0;
          if (v <= 0) continue;
          const y0 = f.sy(below);
          const y1 = f.sy(below + v);
          g.append(svg("rect", { x: (f.sx(r.step) - bw / 2).toFixed(1), y: y1.toFixed(1), width: bw.toFixed(1),
            height: Math.max(0.5, y0 - y1).toFixed(1), class: "point" }));
          drawn++;
        }
        f.root.append(g);
      }
    } else {
      const cum = rows.map(() => 0);
      for (const k of ks) {
        const top = rows.map((r, i) => cum[i] + (r.vals[k] || 0));
        const up = rows.map((r, i) => `${f.sx(r.step).toFixed(1)},${f.sy(top[i]).toFixed(1)}`);
        const down = rows.map((r, i) => `${f.sx(r.step).toFixed(1)},${f.sy(cum[i]).toFixed(1)}`).reverse();
        f.root.append(svg("path", { d: `M${up.join("L")}L${down.join("L")}Z`, fill: colors[k], "fill-opacity": 0.85,
          stroke: "none", "data-bucket": k, "data-points": rows.length, class: "series" }));
        top.forEach((v, i) => { cum[i] = v; });
        drawn += rows.length;
      }
    }
    latest.textContent = `step ${rows[rows.length - 1].step}: ${fmt(totals[totals.length - 1])} eligible`;
    hover(f, rows.map((r) => r.step), (step) => {
      const r = rows.find((x) => x.step === step);
      return [...ks].reverse().map((k) => ({ label: `${k}/${K} correct`, color: colors[k], value: fmt(r.vals[k] || 0) }));
    });
    plot.replaceChildren(f.root);
    setEmpty(fig, false, Math.max(drawn, rows.length));
  }

  function renderHistogram(fig) {
    const plot = fig.querySelector(".plot");
    const latest = fig.querySelector("[data-role=latest]");
    const s = state.stats;
    const K = state.poolInfo ? state.poolInfo.config.k : 8;
    const counts = new Map((s ? s.buckets : []).map((b) => [b.bucket, b.questions]));
    const keys = [...counts.keys()];
    const lo = Math.min(1, ...keys);
    const hi = Math.max(K - 1, ...keys);
    const bins = [];
    for (let k = lo; k <= hi; k++) bins.push({ x: k, label: `${k}`, v: counts.get(k) || 0, color: bucketColor(k, K) });
    bins.push({ x: hi + 1, label: "retired", v: s ? s.retired : 0, color: "#98a2b3" });
    legend(fig, [{ label: "eligible, by correct rollouts of K", color: bucketColor(Math.ceil(K / 2), K) },
      { label: "retired (all K correct)", color: "#98a2b3" }], true);
    const total = bins.reduce((a, b) => a + b.v, 0);
    if (!s || total === 0) {
      plot.replaceChildren(frame([0, 1], 0, 1).root);
      latest.textContent = "";
      setEmpty(fig, true, 0);
      return;
    }
    const labels = Object.fromEntries(bins.map((b) => [b.x, b.label]));
    const f = frame(bins.map((b) => b.x), 0, Math.max(...bins.map((b) => b.v)) * 1.12, (x) => labels[x], true);
    const bw = Math.min(40, (f.pw / bins.length) * 0.7);
    const g = svg("g", {});
    for (const b of bins) {
      if (b.v <= 0) continue;
      const y = f.sy(b.v);
      g.append(svg("rect", { x: (f.sx(b.x) - bw / 2).toFixed(1), y: y.toFixed(1), width: bw.toFixed(1),
        height: Math.max(0.5, f.sy(0) - y).toFixed(1), fill: b.color, class: "point", "data-bucket": b.label }));
      g.append(svg("text", { x: f.sx(b.x).toFixed(1), y: (y - 3).toFixed(1), "text-anchor": "middle",
        class: "bar-label", "font-size": 10, fill: "#475467", text: fmt(b.v) }));
    }
    f.root.append(g);
    latest.textContent = `${fmt(s.eligible)} eligible · ${fmt(s.retired)} retired`;
    plot.replaceChildren(f.root);
    setEmpty(fig, false, bins.filter((b) => b.v > 0).length);
  }

  /** A crosshair and tooltip that follow the pointer to the nearest step. */
  function hover(f, xs, rowsAt) {
    const line = svg("line", { class: "crosshair", y1: M.t, y2: H - M.b, visibility: "hidden" });
    const cover = svg("rect", { x: M.l, y: M.t, width: f.pw, height: f.ph, fill: "transparent" });
    const tip = $("tooltip");
    cover.addEventListener("mousemove", (ev) => {
      const box = f.root.getBoundingClientRect();
      const x = ((ev.clientX - box.left) / box.width) * W;
      let best = xs[0];
      for (const v of xs) if (Math.abs(f.sx(v) - x) < Math.abs(f.sx(best) - x)) best = v;
      line.setAttribute("x1", f.sx(best));
      line.setAttribute("x2", f.sx(best));
      line.setAttribute("visibility", "visible");
      tip.replaceChildren(el("div", {}, el("strong", { text: `step ${best}` })),
        ...rowsAt(best).map((r) => {
          const sw = el("span", { class: "sw" });
          sw.style.background = r.color;
          return el("div", { class: "row" }, el("span", {}, sw, r.label), el("span", { text: r.value }));
        }));
      tip.hidden = false;
      const left = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
      tip.style.left = `${left}px`;
      tip.style.top = `${ev.clientY + 14}px`;
    });
    cover.addEventListener("mouseleave", () => {
      line.setAttribute("visibility", "hidden");
      tip.hidden = true;
    });
    f.root.append(line, cover);
  }

  // ---------------------------------------------------------------------- question browser
  function promptText(q) {
    const user = q.prompt.filter((m) => m.role === "user");
    const m = user.length ? user[user.length - 1] : q.prompt[q.prompt.length - 1];
    return m ? m.content : "";
  }

  function matches(q, needle) {
    if (String(q.id) === needle) return true;
    if (q.ground_truth.toLowerCase().includes(needle)) return true;
    if (q.external_id && q.external_id.toLowerCase().includes(needle)) return true;
    return q.prompt.some((m) => m.content.toLowerCase().includes(needle));
  }

  async function fetchQuestionPage(mode, query, after) {
    if (mode === "list") {
      const r = await api(`${poolPath()}/questions?after=${after}&limit=${PAGE_SIZE}`);
      return { rows: r.data, next: r.next_after, scanned: r.count };
    }
    const needle = query.toLowerCase();
    const rows = [];
    let cursor = after;
    let scanned = 0;
    for (;;) {
      const r = await api(`${poolPath()}/questions?after=${cursor}&limit=500`);
      let i = 0;
      for (; i < r.data.length && rows.length < PAGE_SIZE; i++) {
        if (matches(r.data[i], needle)) rows.push(r.data[i]);
      }
      scanned += i;
      if (rows.length >= PAGE_SIZE) {
        return { rows, next: i > 0 ? r.data[i - 1].id : cursor, scanned };
      }
      if (r.next_after === null || r.next_after === undefined || !r.data.length) return { rows, next: null, scanned };
      cursor = r.next_after;
      if (scanned >= SEARCH_SCAN_LIMIT) return { rows, next: cursor, scanned };
    }
  }

  async function startQuestions(mode, query) {
    const gen = ++state.q.gen;
    state.q = { mode, query, pages: [], index: -1, gen };
    await showQuestionPage(0);
  }

  async function showQuestionPage(index) {
    const q = state.q;
    const gen = q.gen;
    if (index >= q.pages.length) {
      const after = index === 0 ? 0 : q.pages[index - 1].next;
      if (after === null || after === undefined) return;
      $("questions-status").textContent = q.mode === "search" ? `Searching for “${q.query}”…` : "Loading…";
      const page = await guarded("questions", () => fetchQuestionPage(q.mode, q.query, after));
      if (gen !== state.q.gen || !page) return;
      q.pages[index] = page;
    }
    q.index = index;
    renderQuestionRows(q.pages[index].rows, null);
    const offset = q.pages.slice(0, index).reduce((a, p) => a + p.rows.length, 0);
    const page = q.pages[index];
    const n = page.rows.length;
    const total = state.poolInfo ? state.poolInfo.num_questions : null;
    if (q.mode === "list") {
      $("questions-status").textContent = n
        ? `Questions ${offset + 1}–${offset + n}${total !== null ? ` of ${fmt(total)}` : ""}`
        : "";
    } else {
      const scanned = q.pages.slice(0, index + 1).reduce((a, p) => a + p.scanned, 0);
      $("questions-status").textContent =
        `Matches for “${q.query}”: ${offset + n}${page.next !== null ? "+" : ""} ` +
        `(${fmt(scanned)} questions scanned${page.next !== null ? "; Next scans on" : ""})`;
    }
    $("questions-empty").textContent = q.mode === "search" ? `No question matches “${q.query}”.` : "This pool has no questions yet.";
    $("questions-empty").hidden = n > 0;
    $("questions-prev").disabled = index === 0;
    $("questions-next").disabled = page.next === null || page.next === undefined;
  }

  function renderQuestionRows(rows, extra) {
    $("questions-extra-head").textContent = extra ? extra.head : "";
    $("questions-body").replaceChildren(
      ...rows.map((q, i) =>
        el("tr", {
          class: `clickable ${state.question && state.question.id === q.id ? "selected" : ""}`,
          "data-testid": "question-row", "data-qid": q.id, onclick: () => openQuestion(q.id),
        },
        el("td", { class: "mono", text: String(q.id) }),
        el("td", { class: "prompt-cell", title: promptText(q), text: promptText(q) }),
        el("td", {}, el("code", { text: q.ground_truth.length > 40 ? `${q.ground_truth.slice(0, 40)}…` : q.ground_truth })),
        el("td", { class: "muted", text: q.data_source || "" }),
        el("td", { class: "muted", text: extra ? extra.cell(i) : "" })),
      ),
    );
  }

  async function listQuestions() {
    $("question-search").value = "";
    await startQuestions("list", "");
  }

  async function listEligible() {
    if (!state.run) {
      showError(new Error("select a run first: eligible questions belong to a run's replay buckets"), "questions");
      return;
    }
    const gen = ++state.q.gen;
    state.q = { mode: "eligible", query: "", pages: [], index: -1, gen };
    $("questions-status").textContent = "Drawing eligible questions…";
    const r = await guarded("questions", () =>
      api(`${runPath()}/select`, { method: "POST", body: { n: PAGE_SIZE, candidates: "none" } }));
    if (gen !== state.q.gen || !r) return;
    const items = [...r.replay].sort((a, b) => a.question_id - b.question_id);
    const rows = items.map((it) => ({
      id: it.question_id, prompt: it.prompt, ground_truth: it.ground_truth, data_source: it.data_source,
      external_id: null,
    }));
    renderQuestionRows(rows, { head: "bucket · p", cell: (i) => `${items[i].bucket} · ${fmt(items[i].probability)}` });
    $("questions-status").textContent =
      `${rows.length} of ${fmt(r.num_eligible)} eligible questions of run ${r.run}, drawn as replay would draw them`;
    $("questions-empty").textContent = "This run has no eligible questions yet.";
    $("questions-empty").hidden = rows.length > 0;
    $("questions-prev").disabled = true;
    $("questions-next").disabled = true;
  }

  async function openQuestion(id) {
    if (!state.pool) return;
    const pool = state.pool;
    const d = await guarded("question", () => api(`${poolPath()}/questions/${id}?payload=false`));
    if (!d || pool !== state.pool) return;
    state.question = d;
    writeHash();
    for (const tr of $("questions-body").children) tr.classList.toggle("selected", tr.dataset.qid === String(d.id));
    $("question-detail").hidden = false;
    $("question-detail").dataset.qid = String(d.id);
    $("question-id").textContent = `#${d.id}`;
    const meta = [d.data_source && `source ${d.data_source}`, d.external_id && `external id ${d.external_id}`,
      `added ${localTime(d.created_at)}`].filter(Boolean);
    $("question-meta").textContent = meta.join(" · ");
    $("question-prompt").replaceChildren(
      ...d.prompt.map((m) => el("div", { class: "msg", "data-role": m.role },
        el("span", { class: "role", text: m.role }), m.content)),
    );
    $("question-gold").textContent = d.ground_truth;
    const md = Object.keys(d.metadata || {}).length ? `metadata ${JSON.stringify(d.metadata)}` : "";
    $("question-metadata").textContent = md;
    $("states-body").replaceChildren(
      ...d.runs.map((st) => el("tr", { "data-testid": "run-state-row", "data-run": st.run,
        class: st.run === state.run ? "selected" : "" },
      el("td", { text: st.run }),
      el("td", { text: st.num_correct === null ? "–" : `${st.num_correct}` }),
      el("td", { text: st.bucket === null ? (st.retired ? "–" : "not eligible") : String(st.bucket) }),
      el("td", { text: st.retired ? "yes" : "no" }),
      el("td", { text: st.last_step === null ? "–" : String(st.last_step) }))),
    );
    $("states-empty").hidden = d.runs.length > 0;
    $("trajectories-body").replaceChildren(
      ...d.trajectories.map((t) => el("tr", { "data-testid": "trajectory-row", "data-tid": t.id },
        el("td", { class: "mono", text: String(t.id) }),
        el("td", { class: t.reward >= 1 ? "reward-1" : t.reward <= 0 ? "reward-0" : "", text: t.reward.toFixed(2) }),
        el("td", { text: t.entropy === null ? "–" : t.entropy.toFixed(3) }),
        el("td", { text: String(t.policy_version) }),
        el("td", { text: t.source_run || "–" }),
        el("td", { text: String(t.step) }),
        el("td", { "data-testid": "trajectory-tokens", text: fmt(t.num_tokens) }),
        el("td", { class: "muted", text: localTime(t.created_at) }),
        el("td", {
          class: "response-cell", "data-testid": "trajectory-text", "data-has-text": typeof t.text === "string",
          text: typeof t.text === "string" ? t.text : "– (stored without its text)",
        }))),
    );
    $("trajectories-empty").hidden = d.trajectories.length > 0;
    $("question-detail").scrollIntoView({ block: "nearest" });
  }

  // ---------------------------------------------------------------------------------- token
  function renderTokenState() {
    const has = Boolean(token());
    $("token-state").textContent = has ? "token in use" : "anonymous";
    $("token-state").dataset.mode = has ? "token" : "anonymous";
    $("token-input").value = "";
    $("token-input").placeholder = has ? "•••••• (saved)" : "none: anonymous";
  }

  async function reloadAll() {
    clearError();
    const h = {
      pool: state.pool, run: state.run, q: state.question ? state.question.id : null,
      cmp: state.cmp.explicit ? [...state.cmp.selected] : null,
    };
    const ok = await guarded("pools", loadPools);
    if (ok === undefined) return;
    if (h.pool && state.pools.some((p) => p.name === h.pool)) await selectPool(h.pool, h);
  }

  // ---------------------------------------------------------------------------------- wiring
  function wire() {
    $("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const v = $("token-input").value.trim();
      try {
        if (v) localStorage.setItem(TOKEN_KEY, v);
      } catch {
        /* storage unavailable: the token lasts for this page only */
      }
      renderTokenState();
      reloadAll();
    });
    $("token-clear").addEventListener("click", () => {
      try {
        localStorage.removeItem(TOKEN_KEY);
      } catch {
        /* nothing stored */
      }
      renderTokenState();
      reloadAll();
    });
    $("error-close").addEventListener("click", () => clearError());
    $("pools-refresh").addEventListener("click", () => guarded("pools", loadPools));
    $("live-toggle").addEventListener("change", () => {
      updateLive();
      if ($("live-toggle").checked && state.run) schedulePoll(0);
    });
    $("search-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const v = $("question-search").value.trim();
      if (v) startQuestions("search", v);
      else listQuestions();
    });
    $("goto-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const v = $("question-id-input").value.trim();
      if (/^\d+$/.test(v)) openQuestion(Number(v));
    });
    $("eligible-button").addEventListener("click", listEligible);
    $("smoothing").addEventListener("input", () => {
      state.cmp.smoothing = Number($("smoothing").value);
      $("smoothing-value").textContent = state.cmp.smoothing.toFixed(2);
      renderCompare();
    });
    $("compare-add").addEventListener("click", addCompareChart);
    $("compare-csv").addEventListener("click", exportCsv);
    $("trajectories-body").addEventListener("click", (ev) => {
      const row = ev.target.closest("tr");
      if (row) row.classList.toggle("expanded");
    });
    $("list-all-button").addEventListener("click", listQuestions);
    $("questions-prev").addEventListener("click", () => showQuestionPage(state.q.index - 1));
    $("questions-next").addEventListener("click", () => showQuestionPage(state.q.index + 1));
    window.addEventListener("hashchange", () => applyHash());
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && state.run) schedulePoll(0);
    });
  }

  async function start() {
    wire();
    renderTokenState();
    const ok = await guarded("pools", loadPools);
    document.body.dataset.ready = "true";
    if (ok !== undefined || state.pools.length) await applyHash();
    if (!state.pool && state.pools.length === 1) await selectPool(state.pools[0].name);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
