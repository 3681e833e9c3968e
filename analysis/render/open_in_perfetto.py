"""'Open in Perfetto' buttons of the HTML report: one click opens the merged trace at a finding.

The page opens ui.perfetto.dev with the UI's documented postMessage protocol: `window.open` the UI,
send 'PING' until it answers 'PONG', post `{perfetto: {buffer, title, fileName, url?, keepApiOpen}}`
with the trace's bytes, then `{perfetto: {timeStart, timeEnd, viewPercentage}}` (trace-processor time,
ns on the merged clock) so the UI scrolls to the finding once it has loaded the trace. `keepApiOpen`
keeps the UI listening after the trace, for that second message.

Served over http(s), the page fetches the trace from its directory (`merged.perfetto-trace` next to
`report.html`). Opened from disk (file://, the usual case) a page may not read files next to it, so the box
at the top of the report asks for the file once (a file input; the first button click opens the picker)
and keeps its bytes: every button then posts them. The UI answers a file:// page's PING (origin "null")
and asks the user whether to open a trace from "an unknown origin"; the box says to answer yes. Where the
UI does not answer (offline) or the tab is blocked, the box says how to go on. Everything is inline: the
page stays one self-contained file.

`perfettoMessages(link, buffer)` is a pure function; the page stores each button's message (buffer
and BigInts described as text) in `data-perfetto-message` and sets `data-perfetto-ready` on <body>
once its script has run, so a headless browser can check both.
"""

from __future__ import annotations

import json
from html import escape
from typing import Mapping

from fleetscope.traces.layout import MERGED_TRACE

PERFETTO_UI = "https://ui.perfetto.dev"

StepRanges = Mapping[tuple[int, int], tuple[int, int]]
"""(window key, step) -> (start ns, end ns) on the merged clock (`MergeResult.step_ranges_ns()`)."""

CSS = """
button.perfetto{font-size:11px;padding:1px 6px;margin-left:6px;cursor:pointer}
#perfetto-help{border:1px solid #ccc;background:#fffbe6;padding:4px 8px;font-size:12px;margin:8px 0}
#perfetto-help p{margin:4px 0}#perfetto-status:empty{display:none}
"""


def window_key(window: int | None) -> int:
    """The merge's key for a report window (a trace without a window number is window 0)."""
    return 0 if window is None else window


def window_range(ranges: StepRanges | None, window: int | None) -> tuple[int, int] | None:
    spans = [span for (key, _), span in (ranges or {}).items() if key == window_key(window)]
    return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None


def step_range(ranges: StepRanges | None, window: int | None, step: int) -> tuple[int, int] | None:
    return (ranges or {}).get((window_key(window), step)) or window_range(ranges, window)


def button(title: str, span: tuple[int, int] | None, *, trace_file: str = MERGED_TRACE) -> str:
    """An 'Open in Perfetto' button for one finding (scrolled to `span` when known)."""
    link = {"title": title, "file": trace_file}
    if span is not None:
        link |= {"start_ns": str(span[0]), "end_ns": str(span[1])}
    return (f'<button type="button" class="perfetto" data-perfetto-link="{escape(json.dumps(link))}" '
            f'title="{escape(title)}">Open in Perfetto</button>')


def help_box(trace_file: str = MERGED_TRACE) -> str:
    """The box at the top of the report: what the buttons do, the file input they need from file://, and
    (#perfetto-status) what went wrong last."""
    name = escape(trace_file)
    return (f'<div id="perfetto-help"><p><b>Open in Perfetto</b> buttons open {name} (the merged trace next to '
            f'this report) in {PERFETTO_UI} at the finding; the UI needs a connection. Opened from disk, this '
            f'page cannot read that file itself: choose it once here <input type="file" id="perfetto-file" '
            f'accept=".perfetto-trace" aria-label="{name}">, then Perfetto asks whether to open a trace from '
            f'"an unknown origin" (this file): answer yes.</p><p id="perfetto-status" class="bad"></p></div>')


SCRIPT = r"""
(function () {
  'use strict';
  var UI = '%(ui)s';
  function perfettoMessages(link, buffer) {
    var open = {perfetto: {buffer: buffer, title: link.title, fileName: link.file, keepApiOpen: true}};
    if (/^https?:$/.test(location.protocol)) open.perfetto.url = new URL(link.file, location.href).href;
    var scroll = link.start_ns ? {perfetto: {timeStart: BigInt(link.start_ns), timeEnd: BigInt(link.end_ns),
                                             viewPercentage: 0.9}} : null;
    return [open, scroll];
  }
  function described(message) {
    return JSON.stringify(message, function (key, value) {
      if (value instanceof ArrayBuffer) return 'ArrayBuffer(' + value.byteLength + ' bytes)';
      if (typeof value === 'bigint') return value.toString();
      return value;
    });
  }
  function rangeText(link) {
    if (!link.start_ns) return '';
    var ms = Number(BigInt(link.end_ns) - BigInt(link.start_ns)) / 1e6;
    return ' The finding spans ' + ms.toFixed(3) + ' ms from ' + link.start_ns + ' ns on the trace clock.';
  }
  var served = /^https?:$/.test(location.protocol);
  var help = document.getElementById('perfetto-help');
  var status = document.getElementById('perfetto-status');
  var fileInput = document.getElementById('perfetto-file');
  var trace = null;    // the trace's bytes, once fetched or chosen: every button posts them
  var pending = null;  // the finding to open once the file is chosen
  function say(text) {
    status.textContent = text;
    help.scrollIntoView({block: 'nearest'});
  }
  function byHand(link, why) {
    say(why + ' Open ' + UI + ', choose "Open trace file" and pick ' + link.file +
        ' from this report\'s folder.' + rangeText(link));
  }
  function post(win, link, buffer) {
    var messages = perfettoMessages(link, buffer);
    var tries = 0;
    var ping = setInterval(function () {
      if (++tries > 240 || win.closed) { clearInterval(ping); byHand(link, 'Perfetto UI did not answer.'); return; }
      win.postMessage('PING', UI);
    }, 250);
    function onMessage(event) {
      if (event.source !== win || event.data !== 'PONG') return;
      window.removeEventListener('message', onMessage);
      clearInterval(ping);
      win.postMessage(messages[0], UI);
      // the UI scrolls once the trace is loaded, which waits for the user's yes from a file:// page
      if (messages[1]) [1500, 4000, 8000, 15000, 30000, 60000].forEach(function (delay) {
        setTimeout(function () { if (!win.closed) win.postMessage(messages[1], UI); }, delay);
      });
    }
    window.addEventListener('message', onMessage);
  }
  function openWith(link, buffer) {
    var win = window.open(UI);
    if (!win) { say('The browser blocked the new tab: press Open in Perfetto again (or allow pop-ups).'); return; }
    status.textContent = '';
    post(win, link, buffer);
  }
  function askForFile(link, why) {
    pending = link;
    say(why + 'Choose ' + link.file + ' from this report\'s folder in the box above; the finding then opens ' +
        'in Perfetto.' + rangeText(link));
    fileInput.click();
  }
  function openLink(link) {
    if (navigator.onLine === false) { byHand(link, 'This browser is offline.'); return; }
    if (trace) { openWith(link, trace); return; }
    if (!served) { askForFile(link, ''); return; }
    var win = window.open(UI);
    if (!win) { byHand(link, 'The browser blocked the new tab.'); return; }
    fetch(link.file).then(function (response) {
      if (!response.ok) throw new Error('HTTP ' + response.status);
      return response.arrayBuffer();
    }).then(function (buffer) { trace = buffer; post(win, link, buffer); }, function () {
      win.close();
      askForFile(link, 'This page could not fetch ' + link.file + ' from its server. ');
    });
  }
  fileInput.addEventListener('change', function () {
    var file = fileInput.files[0];
    if (!file) return;
    file.arrayBuffer().then(function (buffer) {
      trace = buffer;
      var link = pending;
      pending = null;
      if (link) openWith(link, buffer);
      else status.textContent = '';
    });
  });
  var buttons = document.querySelectorAll('button[data-perfetto-link]');
  Array.prototype.forEach.call(buttons, function (b) {
    var link = JSON.parse(b.getAttribute('data-perfetto-link'));
    b.setAttribute('data-perfetto-message', perfettoMessages(link, new ArrayBuffer(0)).map(described).join('\n'));
    b.addEventListener('click', function () { openLink(link); });
  });
  window.perfettoMessages = perfettoMessages;
  document.body.setAttribute('data-perfetto-ready', String(buttons.length));
})();
""" % {"ui": PERFETTO_UI}


def script() -> str:
    return f"<script>{SCRIPT}</script>"
