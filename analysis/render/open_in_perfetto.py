"""'Open in Perfetto' buttons of the HTML report: one click opens the merged trace at a finding.

The page opens ui.perfetto.dev with the UI's documented postMessage protocol: `window.open` the UI,
send 'PING' until it answers 'PONG', post `{perfetto: {buffer, title, fileName, url?, keepApiOpen}}`
with the trace's bytes, then `{perfetto: {timeStart, timeEnd, viewPercentage}}` (trace-processor time,
ns on the merged clock) so the UI scrolls to the finding once it has loaded the trace. `keepApiOpen`
keeps the UI listening after the trace, for that second message.

The trace is fetched from the report's directory (`merged.perfetto-trace` next to `report.html`);
where fetching fails (the page opened from file://), the page asks for the file with a file input;
where the UI does not answer (offline), it shows how to open the file by hand. Everything is inline:
the page stays one self-contained file.

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
#perfetto-help{border:1px solid #ccc;background:#fffbe6;padding:8px;font-size:12px;margin:8px 0}
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
    return (f'<div id="perfetto-help" hidden><p id="perfetto-help-text"></p>'
            f'<p><label>Choose {escape(trace_file)} (next to this report): '
            f'<input type="file" id="perfetto-file" accept=".perfetto-trace"></label></p></div>')


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
  var help = document.getElementById('perfetto-help');
  var helpText = document.getElementById('perfetto-help-text');
  var fileInput = document.getElementById('perfetto-file');
  var pending = null;
  function showHelp(text) {
    helpText.textContent = text;
    help.hidden = false;
    help.scrollIntoView({block: 'nearest'});
  }
  function byHand(link, why) {
    showHelp(why + ' Open ' + UI + ', choose "Open trace file" and pick ' + link.file +
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
      if (messages[1]) [1500, 4000, 8000, 15000].forEach(function (delay) {
        setTimeout(function () { if (!win.closed) win.postMessage(messages[1], UI); }, delay);
      });
    }
    window.addEventListener('message', onMessage);
  }
  function openLink(link) {
    if (navigator.onLine === false) { byHand(link, 'This browser is offline.'); return; }
    var win = window.open(UI);
    if (!win) { byHand(link, 'The browser blocked the new tab.'); return; }
    fetch(link.file).then(function (response) {
      if (!response.ok) throw new Error('HTTP ' + response.status);
      return response.arrayBuffer();
    }).then(function (buffer) { post(win, link, buffer); }, function () {
      win.close();
      pending = link;
      var served = /^https?:$/.test(location.protocol);
      showHelp('This page could not read ' + link.file + ' from its folder. ' + (served
        ? 'Choose it below and it opens in Perfetto.'
        : 'Opened from a file, the page cannot talk to the Perfetto UI: run "python3 -m http.server" in the ' +
          'report folder and open report.html through it (localhost, port 8000), or open ' + UI +
          ', choose "Open trace file" and pick ' + link.file + '.') + rangeText(link));
    });
  }
  fileInput.addEventListener('change', function () {
    var file = fileInput.files[0];
    if (!file || !pending) return;
    var link = pending;
    var win = window.open(UI);
    if (!win) { byHand(link, 'The browser blocked the new tab.'); return; }
    file.arrayBuffer().then(function (buffer) { post(win, link, buffer); });
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
