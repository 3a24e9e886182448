// Shared by the view's pages: the JSON API, DOM building (text only, never HTML), formatting.
// Model output, tool output and episode fields are untrusted text: they enter the page through
// textContent, never innerHTML, so nothing in a run can run script in the view.
"use strict";

const VIEW = "/view";

class ApiError extends Error {}

async function api(path) {
  const resp = await fetch(VIEW + "/api" + path, {credentials: "same-origin", cache: "no-store"});
  if (resp.status === 401) {
    throw new ApiError("the view's cookie has lapsed: open the view's link with its token again");
  }
  const body = await resp.json();
  if (!resp.ok) {
    throw new ApiError((body.error && body.error.message) || ("HTTP " + resp.status));
  }
  return body;
}

// el("div", {class: "x", "data-i": 3}, "text", child, ...)
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else node.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (typeof x !== "number") return String(x);
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return x.toExponential(2);
  return x.toFixed(digits === undefined ? (Number.isInteger(x) ? 0 : 3) : digits);
}

function fmtTime(t) {
  if (!t) return "–";
  const d = new Date(t * 1000);
  return d.toLocaleString(undefined, {hour12: false});
}

function setStatus(text, ok) {
  const s = document.getElementById("status");
  if (!s) return;
  s.textContent = text;
  s.className = ok ? "ok" : "bad";
}

// eight colours for policy versions and chart series (colour-blind-safe order)
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#e377c2"];
