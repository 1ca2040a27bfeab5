// dedupd dashboard: polls the JSON API every 2 s. No external scripts or fonts.
"use strict";

const POLL_MS = 2000;
let previous = null; // {at, processed: {name: n}}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
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
    for (const c of cells) cell(tr, String(c));
    body.appendChild(tr);
  }
}

async function json(url) {
  const r = await fetch(url, { cache: "no-store" });
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
    const dead = await records("deadletters", subscribers);
    fill("deadletters", dead.map(([s, r]) => [s, r.id, r.message_id || "", reason(r), r.attempts ?? ""]), "no dead letters");
    const quar = await records("quarantine", subscribers);
    fill("quarantine", quar.map(([s, r]) => [s, r.id, r.message_id || "", reason(r)]), "nothing quarantined");
    status.textContent = "live · updated " + new Date(now).toLocaleTimeString();
    status.className = "status ok";
  } catch (e) {
    status.textContent = "error: " + e.message;
    status.className = "status bad";
  }
}

refresh();
setInterval(refresh, POLL_MS);
