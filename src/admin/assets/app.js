// dedupd dashboard: polls the JSON API every 2 s. No external scripts or fonts.
//
// Trends are drawn from the samples this page polled (the last HISTORY of them, five
// minutes): the server keeps no history for it, so a reloaded page starts its curves again.
"use strict";

const POLL_MS = 2000;
const HISTORY = 150; // samples kept per subscriber: 5 minutes at one every 2 s
const TOKEN_KEY = "dedupd-token";
// Sizes of the `<template id="spark">` in index.html (its <svg> is parsed into the SVG
// namespace there, so this script needs no namespace URL).
const SPARK_W = 160;
const SPARK_H = 28;

let previous = null; // {at, processed: {name: n}}
const history = new Map(); // subscriber -> [{at, total, duplicates, acked, ackUs}]
const disk = []; // [{at, bytes}]

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let neg = n < 0;
  n = Math.abs(n);
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (neg ? "-" : "") + (i === 0 ? n : n.toFixed(1)) + " " + units[i];
}

function cell(row, content, cls) {
  const td = document.createElement("td");
  if (content instanceof Node) td.appendChild(content);
  else td.textContent = content;
  if (cls) td.className = cls;
  row.appendChild(td);
}

function fill(tableId, rows, empty) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren();
  if (rows.length === 0) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = 20;
    td.className = "empty";
    td.textContent = empty;
    tr.appendChild(td);
    body.appendChild(tr);
    return;
  }
  for (const cells of rows) {
    const tr = document.createElement("tr");
    for (const c of cells) cell(tr, c instanceof Node ? c : String(c));
    body.appendChild(tr);
  }
}

// The API token, if the operator entered one: kept for this tab only (sessionStorage).
function token() {
  return document.getElementById("token").value.trim();
}

function headers() {
  const t = token();
  return t ? { Authorization: "Bearer " + t } : {};
}

async function json(url) {
  const r = await fetch(url, { cache: "no-store", headers: headers() });
  if (!r.ok) throw new Error(url + ": HTTP " + r.status);
  return r.json();
}

// With a token configured, lists read without it leave out failure reasons.
function reason(r) {
  if (r.reason !== undefined) return r.reason;
  return r.redacted ? "(hidden without the token)" : "";
}

async function records(kind, subs) {
  const out = [];
  for (const s of subs) {
    const page = await json("/v1/subscribers/" + encodeURIComponent(s.subscriber) + "/" + kind + "?limit=20");
    for (const r of page.records) out.push([s.subscriber, r]);
  }
  return out;
}

// --- trends -----------------------------------------------------------------------------

// A refresh right after an action is not a sample: intervals shorter than half a poll
// would make spikes out of nothing.
function remember(list, sample) {
  if (list.length && sample.at - list[list.length - 1].at < POLL_MS / 2) return;
  list.push(sample);
  while (list.length > HISTORY) list.shift();
}

// Per interval between two samples: msgs/s, duplicate share (%) and mean ack latency (ms).
function series(samples) {
  const rate = [], dup = [], ack = [];
  for (let i = 1; i < samples.length; i++) {
    const a = samples[i - 1], b = samples[i];
    const dt = Math.max(0.001, (b.at - a.at) / 1000);
    const dn = Math.max(0, b.total - a.total);
    rate.push(dn / dt);
    dup.push(dn === 0 ? 0 : 100 * Math.max(0, b.duplicates - a.duplicates) / dn);
    const acks = b.acked - a.acked;
    ack.push(acks > 0 ? (b.ackUs - a.ackUs) / acks / 1000 : (ack.length ? ack[ack.length - 1] : 0));
  }
  return { rate, dup, ack };
}

// An inline SVG line of `values`, scaled to its own maximum; `data-points` says how many.
function sparkline(values, label) {
  const svg = document.getElementById("spark").content.firstElementChild.cloneNode(true);
  svg.setAttribute("aria-label", label);
  const path = svg.querySelector("path");
  const max = Math.max(...values, 0);
  const step = values.length > 1 ? SPARK_W / (HISTORY - 1) : 0;
  const x0 = SPARK_W - step * (values.length - 1);
  const y = (v) => (SPARK_H - 2 - (max > 0 ? (v / max) * (SPARK_H - 4) : 0)).toFixed(1);
  const d = values.map((v, i) => (i === 0 ? "M" : "L") + (x0 + i * step).toFixed(1) + "," + y(v));
  path.setAttribute("d", d.join(" "));
  path.setAttribute("data-points", String(values.length));
  return svg;
}

function trend(values, label, format) {
  const span = document.createElement("span");
  span.className = "trend";
  span.appendChild(sparkline(values, label));
  const now = document.createElement("span");
  now.className = "now";
  now.textContent = values.length ? format(values[values.length - 1]) : "–";
  span.appendChild(now);
  return span;
}

function drawTrends(subscribers, now) {
  const names = new Set(subscribers.map((s) => s.subscriber));
  for (const name of [...history.keys()]) if (!names.has(name)) history.delete(name);
  const rows = [];
  for (const s of subscribers) {
    if (!history.has(s.subscriber)) history.set(s.subscriber, []);
    const h = history.get(s.subscriber);
    remember(h, {
      at: now, total: s.processed + s.duplicates + s.quarantined, duplicates: s.duplicates,
      acked: s.acked || 0, ackUs: s.ack_latency_us_total || 0,
    });
    const { rate, dup, ack } = series(h);
    rows.push([
      s.subscriber,
      trend(rate, s.subscriber + " msgs/s", (v) => v.toFixed(0) + " msgs/s"),
      trend(dup, s.subscriber + " duplicate rate", (v) => v.toFixed(1) + " %"),
      trend(ack, s.subscriber + " ack latency", (v) => v.toFixed(1) + " ms"),
    ]);
  }
  fill("trends", rows, "no subscribers yet");
  if (subscribers.length) {
    remember(disk, { at: now, bytes: subscribers[0].data_dir_bytes });
    const growth = disk.length > 1 ? disk[disk.length - 1].bytes - disk[0].bytes : 0;
    const minutes = disk.length > 1 ? (disk[disk.length - 1].at - disk[0].at) / 60000 : 0;
    const box = document.getElementById("disk-trend");
    box.replaceChildren(sparkline(disk.map((d) => d.bytes), "data directory bytes"));
    document.getElementById("disk-growth").textContent = minutes > 0
      ? bytes(growth) + " in the last " + minutes.toFixed(1) + " min" : "–";
  }
}

// --- replay and discard -----------------------------------------------------------------

const KINDS = {
  deadletters: { label: "dead letter" },
  quarantine: { label: "quarantined message" },
};

function actions(kind, subscriber, record) {
  const span = document.createElement("span");
  span.className = "actions";
  for (const action of ["replay", "discard"]) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = action;
    b.className = action;
    b.dataset.action = action;
    b.dataset.kind = kind;
    b.dataset.subscriber = subscriber;
    b.dataset.record = record;
    span.appendChild(b);
  }
  return span;
}

function say(text, ok) {
  const el = document.getElementById("action");
  el.textContent = text;
  el.className = "action " + (ok ? "ok" : "bad");
}

async function act(button) {
  const { action, kind, subscriber, record } = button.dataset;
  const what = KINDS[kind].label + " " + record + " of " + subscriber;
  if (action === "discard" && !confirm("Discard " + what + "? Its payload is deleted for good.")) return;
  const base = "/v1/subscribers/" + encodeURIComponent(subscriber) + "/" + kind + "/" + encodeURIComponent(record);
  const [method, url] = action === "replay" ? ["POST", base + "/replay"] : ["DELETE", base];
  button.disabled = true;
  try {
    const r = await fetch(url, { method, cache: "no-store", headers: headers() });
    const body = await r.json().catch(() => ({}));
    if (r.status === 401) {
      say(action + " refused (401): the server needs its API token; enter it above", false);
      document.getElementById("token").focus();
    } else if (r.status === 403) {
      say(action + " refused (403): " + (body.message || "the API token is wrong"), false);
    } else if (!r.ok) {
      say(action + " of " + what + " failed (" + r.status + "): " + (body.message || ""), false);
    } else if (action === "replay") {
      say("replayed " + what + ": " + body.outcome + (body.reason ? " (" + body.reason + ")" : ""), true);
    } else {
      say("discarded " + what, true);
    }
  } catch (e) {
    say(action + " of " + what + " failed: " + e.message, false);
  } finally {
    button.disabled = false;
  }
  await refresh();
}

// --- polling ----------------------------------------------------------------------------

async function refresh() {
  const status = document.getElementById("status");
  try {
    const { subscribers } = await json("/v1/subscribers");
    const now = Date.now();
    const rows = subscribers.map((s) => {
      const total = s.processed + s.duplicates + s.quarantined;
      let rate = "–";
      if (previous && previous.processed[s.subscriber] !== undefined) {
        const dt = (now - previous.at) / 1000;
        rate = Math.max(0, (total - previous.processed[s.subscriber]) / dt).toFixed(0);
      }
      const dupRate = total === 0 ? "0.0 %" : (100 * s.duplicates / total).toFixed(1) + " %";
      return [s.subscriber, rate, s.processed, s.duplicates, dupRate, s.quarantined, s.dead_lettered,
        s.claims_stored, s.generations, (100 * s.filter_false_positive_rate).toFixed(4) + " %",
        bytes(s.filter_bytes + s.index_bytes)];
    });
    previous = { at: now, processed: {} };
    for (const s of subscribers) previous.processed[s.subscriber] = s.processed + s.duplicates + s.quarantined;
    fill("subscribers", rows, "no subscribers yet");
    document.getElementById("disk").textContent = subscribers.length ? bytes(subscribers[0].data_dir_bytes) : "–";
    drawTrends(subscribers, now);
    const dead = await records("deadletters", subscribers);
    fill("deadletters", dead.map(([s, r]) => [s, r.id, r.message_id || "", reason(r), r.attempts ?? "",
      actions("deadletters", s, r.id)]), "no dead letters");
    const quar = await records("quarantine", subscribers);
    fill("quarantine", quar.map(([s, r]) => [s, r.id, r.message_id || "", reason(r),
      actions("quarantine", s, r.id)]), "nothing quarantined");
    status.textContent = "live · updated " + new Date(now).toLocaleTimeString();
    status.className = "status ok";
  } catch (e) {
    status.textContent = "error: " + e.message;
    status.className = "status bad";
  }
}

function start() {
  const input = document.getElementById("token");
  input.value = sessionStorage.getItem(TOKEN_KEY) || "";
  input.addEventListener("change", () => {
    if (token()) sessionStorage.setItem(TOKEN_KEY, token());
    else sessionStorage.removeItem(TOKEN_KEY);
    refresh();
  });
  document.querySelector("main").addEventListener("click", (e) => {
    const b = e.target.closest("button[data-action]");
    if (b && !b.disabled) act(b);
  });
  refresh();
  setInterval(refresh, POLL_MS);
}

start();
