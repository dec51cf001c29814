// quartet annotate: rank one prompt's answers, keyboard first. Every text from the server is put in the page with
// textContent, never as markup: an answer holding <script> or <img onerror=...> shows as those characters.
// The next item is shown only after the server said the judgment is on disk.
"use strict";

const NAME_KEY = "quartet-annotator";
const token = new URLSearchParams(location.search).get("token");
const state = {
  name: null,
  item: null,
  ranking: [], // groups of answer indices, best first; a group of 2+ is a tie
  flags: {}, // answer index -> reason
  focus: 0,
  flagging: null, // the answer whose reason box is open
  busy: false,
  progress: null,
};

const $ = (selector) => document.querySelector(selector);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  if (token) headers["X-Quartet-Token"] = token;
  const init = { method, headers };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  let data = null;
  try {
    data = await response.json();
  } catch (e) {
    data = null;
  }
  if (!response.ok) throw new Error((data && data.error) || `HTTP ${response.status}`);
  return data;
}

function status(text, error = false) {
  const node = $("#status");
  node.textContent = text;
  node.classList.toggle("error", error);
}

// ------------------------------------------------------------------ the draft: ranking being built
function groupOf(i) {
  return state.ranking.findIndex((group) => group.includes(i));
}

function unrank(i) {
  const g = groupOf(i);
  if (g < 0) return;
  state.ranking[g] = state.ranking[g].filter((x) => x !== i);
  if (!state.ranking[g].length) state.ranking.splice(g, 1);
}

function pick(i) {
  state.focus = i;
  if (i in state.flags) {
    status(`answer ${i + 1} is flagged: press f on it to unflag`);
  } else if (groupOf(i) >= 0) {
    unrank(i);
  } else {
    state.ranking.push([i]);
  }
  changed();
}

function tie(i) {
  if (i in state.flags) return;
  const g = groupOf(i);
  if (g < 0) {
    if (!state.ranking.length) {
      status("rank an answer first: t puts the selected answer in the group above it");
      return;
    }
    state.ranking[state.ranking.length - 1].push(i);
  } else if (g === 0) {
    status(`answer ${i + 1} is in the best group: there is no group above to tie with`);
    return;
  } else {
    unrank(i);
    state.ranking[g - 1].push(i);
  }
  changed();
}

function move(i, dir) {
  const g = groupOf(i);
  if (g < 0) return;
  if (state.ranking[g].length > 1) {
    unrank(i); // its group stays, at index g
    state.ranking.splice(dir < 0 ? g : g + 1, 0, [i]);
  } else {
    const h = g + dir;
    if (h < 0 || h >= state.ranking.length) return;
    [state.ranking[g], state.ranking[h]] = [state.ranking[h], state.ranking[g]];
  }
  changed();
}

function flag(i) {
  if (i in state.flags) {
    delete state.flags[i];
    changed();
    return;
  }
  state.flagging = i;
  render();
}

function setFlag(i, reason) {
  state.flagging = null;
  if (reason.trim()) {
    state.flags[i] = reason.trim();
    unrank(i);
  }
  changed();
}

function unranked() {
  if (!state.item) return [];
  return state.item.answers.map((_, i) => i).filter((i) => !(i in state.flags) && groupOf(i) < 0);
}

function draftKey() {
  return `quartet-draft:${state.name}:${state.item.id}`;
}

function changed() {
  if (state.item) {
    sessionStorage.setItem(draftKey(), JSON.stringify({ ranking: state.ranking, flags: state.flags }));
  }
  render();
}

function restoreDraft() {
  state.ranking = [];
  state.flags = {};
  state.focus = 0;
  state.flagging = null;
  if (!state.item) return;
  try {
    const draft = JSON.parse(sessionStorage.getItem(draftKey()) || "null");
    if (draft) {
      state.ranking = draft.ranking;
      state.flags = draft.flags;
    }
  } catch (e) {
    sessionStorage.removeItem(draftKey());
  }
}

// ------------------------------------------------------------------ talking to the server
async function loadNext() {
  const data = await api("GET", `/api/next?annotator=${encodeURIComponent(state.name)}`);
  state.item = data.item;
  restoreDraft();
  showProgress(data.progress);
}

async function submit() {
  if (state.busy || !state.item) return;
  const left = unranked();
  if (left.length > 1) {
    status(`rank every answer first (${left.length} left), or flag the unusable ones with f`, true);
    return;
  }
  const ranking = left.length === 1 ? [...state.ranking, [left[0]]] : state.ranking; // the last one is last
  await write("judge", { annotator: state.name, item: state.item.id, ranking, flags: state.flags },
    `saved your ranking of item ${state.item.position}`);
}

async function skip() {
  if (state.busy || !state.item) return;
  await write("skip", { annotator: state.name, item: state.item.id }, `skipped item ${state.item.position}`);
}

async function write(what, body, done) {
  state.busy = true;
  status("saving...");
  render();
  try {
    await api("POST", `/api/${what}`, body);
    sessionStorage.removeItem(`quartet-draft:${state.name}:${body.item}`);
    await loadNext();
    status(done);
  } catch (e) {
    status(`not saved: ${e.message}`, true);
  } finally {
    state.busy = false;
    render();
  }
}

async function undo() {
  if (state.busy) return;
  state.busy = true;
  render();
  try {
    const data = await api("POST", "/api/undo", { annotator: state.name });
    const undone = data.undone;
    if (undone.event === "rank") {
      sessionStorage.setItem(`quartet-draft:${state.name}:${undone.item}`,
        JSON.stringify({ ranking: undone.ranking, flags: undone.flags }));
    }
    await loadNext();
    status(`undid your ${undone.event === "rank" ? "ranking" : "skip"}: you can judge that item again`);
  } catch (e) {
    status(`nothing undone: ${e.message}`, true);
  } finally {
    state.busy = false;
    render();
  }
}

async function showAgreement() {
  try {
    const data = await api("GET", "/api/agreement");
    const people = data.people;
    const fmt = (x) => (x === null || x === undefined ? "n/a" : x.toFixed(2));
    let text = `${people.items} items ranked by 2+ people`;
    if (people.items) text += `; pairwise agreement ${fmt(people.agreement)}, ${people.kappa_kind} kappa ${fmt(people.kappa)}`;
    const mine = (data.judge || []).find((a) => a.annotator === state.name);
    if (mine) text += `; you agree with the AI judge on ${fmt(mine.share)} of ${mine.pairs} pairs`;
    $("#agreement").textContent = text;
  } catch (e) {
    $("#agreement").textContent = `not available: ${e.message}`;
  }
}

// ------------------------------------------------------------------ drawing
function showProgress(p) {
  state.progress = p;
  const bar = $("#bar");
  bar.max = Math.max(1, p.items);
  bar.value = p.complete;
  const each = p.per_item > 1 ? ` (${p.per_item} people each)` : "";
  $("#counts").textContent = `${p.complete} / ${p.items} items done${each} · mine ${p.mine} · skipped ${p.skipped}`;
}

function rankLabel(i) {
  if (i in state.flags) return "flagged";
  const g = groupOf(i);
  if (g < 0) return "";
  return state.ranking[g].length > 1 ? `#${g + 1} (tie)` : `#${g + 1}`;
}

function button(label, title, action) {
  const b = el("button", "small", label);
  b.type = "button";
  b.title = title;
  b.addEventListener("click", (event) => {
    event.stopPropagation();
    action();
  });
  return b;
}

function renderPrompt(prompt) {
  const box = $("#prompt");
  box.replaceChildren();
  if (typeof prompt === "string") {
    box.append(el("div", "text", prompt));
    return;
  }
  for (const message of prompt) {
    const turn = el("div", "turn");
    turn.append(el("span", "role", message.role), el("div", "text", message.content));
    box.append(turn);
  }
}

function renderAnswer(answer, i) {
  const card = el("div", "answer");
  card.dataset.index = String(i);
  card.classList.toggle("focused", i === state.focus);
  card.classList.toggle("ranked", groupOf(i) >= 0);
  card.classList.toggle("flagged", i in state.flags);
  card.addEventListener("click", () => pick(i));
  const head = el("div", "head");
  head.append(el("span", "num", String(i + 1)), el("span", "rank", rankLabel(i)));
  const tools = el("span", "tools");
  tools.append(
    button("tie", "tie with the group above (t)", () => { state.focus = i; tie(i); }),
    button("\u2191", "move up (Shift+\u2191)", () => { state.focus = i; move(i, -1); }),
    button("\u2193", "move down (Shift+\u2193)", () => { state.focus = i; move(i, 1); }),
    button(i in state.flags ? "unflag" : "flag", "flag as unusable (f)", () => { state.focus = i; flag(i); }),
  );
  head.append(tools);
  card.append(head);
  const text = el("div", "text", answer);
  if (!answer.trim()) text.classList.add("empty");
  card.append(text);
  if (i in state.flags) card.append(el("div", "reason", `flagged: ${state.flags[i]}`));
  if (state.flagging === i) card.append(reasonBox(i));
  return card;
}

function reasonBox(i) {
  const form = el("form", "reason-form");
  form.addEventListener("click", (event) => event.stopPropagation());
  const input = el("input");
  input.id = "reason-input";
  input.placeholder = `why is answer ${i + 1} unusable? (Enter to flag, Esc to cancel)`;
  input.maxLength = state.item.reason_max;
  input.addEventListener("keydown", (event) => {
    if (event.key === "Escape") {
      event.preventDefault();
      state.flagging = null;
      render();
    }
  });
  const ok = el("button", "small", "flag");
  ok.type = "submit";
  form.append(input, ok);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    setFlag(i, input.value);
  });
  setTimeout(() => input.focus(), 0);
  return form;
}

function render() {
  $("#who-name").textContent = state.name ? `annotating as ${state.name}` : "";
  $("#rename").hidden = !state.name;
  $("#name-form").hidden = !!state.name;
  const item = state.item;
  $("#item").hidden = !state.name || !item;
  $("#done").hidden = !state.name || !!item || !state.progress;
  for (const b of document.querySelectorAll("#actions button, #done button")) b.disabled = state.busy;
  if (!item) {
    const p = state.progress;
    if (p) $("#done-text").textContent = `${p.complete} of ${p.items} items have their judgments; you gave ${p.mine}.`;
    return;
  }
  $("#position").textContent = `(item ${item.position} of ${state.progress ? state.progress.items : "?"})`;
  renderPrompt(item.prompt);
  $("#answers").replaceChildren(...item.answers.map(renderAnswer));
  const groups = state.ranking.map((g) => g.map((i) => i + 1).join(" = "));
  const left = unranked().length;
  const flagged = Object.keys(state.flags).length;
  $("#ranking").textContent = (groups.length ? `ranking: ${groups.join("  >  ")}` : "ranking: (none yet)")
    + (left ? ` · ${left} to rank` : " · complete") + (flagged ? ` · ${flagged} flagged` : "");
}

// ------------------------------------------------------------------ keys and buttons
function onKey(event) {
  if (!state.name || event.target.closest("input, textarea")) return;
  const key = event.key;
  if ((event.ctrlKey || event.metaKey) && key.toLowerCase() === "z") {
    event.preventDefault();
    undo();
    return;
  }
  if (event.ctrlKey || event.metaKey || event.altKey) return;
  if (key === "u") {
    undo();
  } else if (!state.item || state.busy) {
    return;
  } else if (/^[1-9]$/.test(key) && Number(key) <= state.item.answers.length) {
    pick(Number(key) - 1);
  } else if (key === "ArrowUp" || key === "ArrowDown") {
    const dir = key === "ArrowUp" ? -1 : 1;
    if (event.shiftKey) {
      move(state.focus, dir);
    } else {
      state.focus = Math.min(state.item.answers.length - 1, Math.max(0, state.focus + dir));
      render();
    }
  } else if (key === "t") {
    tie(state.focus);
  } else if (key === "f") {
    flag(state.focus);
  } else if (key === "s") {
    skip();
  } else if (key === "Enter") {
    submit();
  } else if (key === "Backspace") {
    const last = state.ranking[state.ranking.length - 1];
    if (last) unrank(last[last.length - 1]);
    changed();
  } else if (key === "Escape") {
    state.ranking = [];
    changed();
  } else {
    return;
  }
  event.preventDefault();
}

async function start() {
  render();
  try {
    await loadNext();
    status("");
  } catch (e) {
    status(`cannot reach the server: ${e.message}`, true);
  }
  render();
  showAgreement();
}

function init() {
  document.addEventListener("keydown", onKey);
  $("#submit").addEventListener("click", submit);
  $("#skip").addEventListener("click", skip);
  $("#undo").addEventListener("click", undo);
  $("#undo-done").addEventListener("click", undo);
  $("#refresh").addEventListener("click", start);
  $("#clear").addEventListener("click", () => { state.ranking = []; changed(); });
  $("#agreement-box").addEventListener("toggle", showAgreement);
  $("#rename").addEventListener("click", () => {
    localStorage.removeItem(NAME_KEY);
    state.name = null;
    state.item = null;
    render();
    $("#name-input").focus();
  });
  $("#name-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const name = $("#name-input").value.trim();
    if (!name) return;
    localStorage.setItem(NAME_KEY, name);
    state.name = name;
    start();
  });
  state.name = localStorage.getItem(NAME_KEY);
  if (state.name) {
    start();
  } else {
    render();
    $("#name-input").focus();
  }
}

init();
