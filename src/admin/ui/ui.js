// The operator page's own script (src/admin/ui): times in the browser's time zone (the UTC
// value stays in the title), live countdowns to due times, sorting a table's rows by a
// column, and the Overview's charts (uPlot), fed by polling /ui/stats.json. No build step.
(function () {
  "use strict";
  function localTimes(root) {
    root.querySelectorAll("time[datetime]").forEach(function (t) {
      var d = new Date(t.getAttribute("datetime"));
      if (!isNaN(d)) {
        t.textContent = d.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "medium" });
      }
    });
  }
  function span(ms) {
    var s = Math.round(Math.abs(ms) / 1000), out;
    if (s < 60) out = s + "s";
    else if (s < 3600) out = Math.floor(s / 60) + "m " + (s % 60) + "s";
    else out = Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
    return out;
  }
  function countdowns() {
    var now = Date.now();
    document.querySelectorAll(".countdown[data-due]").forEach(function (c) {
      var left = new Date(c.getAttribute("data-due")).getTime() - now;
      c.textContent = left >= 0 ? "(in " + span(left) + ")" : "(overdue by " + span(left) + ")";
      c.classList.toggle("overdue", left < 0);
    });
  }
  function sortable(root) {
    root.querySelectorAll("table.sortable th button[data-sort]").forEach(function (b) {
      b.addEventListener("click", function () {
        var th = b.closest("th"), table = b.closest("table"), body = table.tBodies[0];
        var col = Array.prototype.indexOf.call(th.parentNode.children, th);
        var num = b.getAttribute("data-sort") === "num";
        var asc = b.getAttribute("aria-sort") !== "ascending";
        table.querySelectorAll("th button").forEach(function (o) { o.removeAttribute("aria-sort"); });
        b.setAttribute("aria-sort", asc ? "ascending" : "descending");
        var key = function (tr) {
          var td = tr.children[col];
          if (!td) return "";
          var v = td.getAttribute("data-value") || td.textContent.trim();
          return num ? parseFloat(v) || 0 : v;
        };
        var rows = Array.prototype.slice.call(body.rows).filter(function (r) { return r.children.length > 1; });
        rows.sort(function (x, y) {
          var a = key(x), c = key(y);
          var r = a < c ? -1 : a > c ? 1 : 0;
          return asc ? r : -r;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  }
  // The Overview's charts: rates from two readings of the counters, the last 10 minutes.
  function charts() {
    var init = document.getElementById("stats-init");
    var ratesEl = document.getElementById("chart-rates"), pendEl = document.getElementById("chart-pending");
    if (!init || !ratesEl || !window.uPlot) return;
    var KEEP = 300, prev = JSON.parse(init.textContent);
    var t = [], up = [], out = [], pend = [], coal = [];
    function width(el) { return Math.max(260, el.clientWidth || 300); }
    // axes: the time axis, the left one, and a right one for a series on scale "c".
    function mk(el, series, right) {
      var axes = [{}, {}];
      if (right) axes.push({ scale: "c", side: 1, grid: { show: false } });
      return new uPlot({ width: width(el), height: 180, series: [{}].concat(series), axes: axes, legend: { live: false } }, [[]].concat(series.map(function () { return []; })), el);
    }
    var rates = mk(ratesEl, [{ label: "uploads/s", stroke: "#0550ae", width: 2 }, { label: "ready/s", stroke: "#116329", width: 2 }]);
    var pending = mk(pendEl, [{ label: "open rounds", stroke: "#8250df", width: 2 }, { label: "uploads per ready", stroke: "#bc4c00", width: 2, scale: "c" }], true);
    window.addEventListener("resize", function () {
      rates.setSize({ width: width(ratesEl), height: 180 });
      pending.setSize({ width: width(pendEl), height: 180 });
    });
    function push(s) {
      var dt = (s.at_ms - prev.at_ms) / 1000;
      if (dt <= 0) return;
      t.push(s.at_ms / 1000);
      up.push((s.uploads - prev.uploads) / dt);
      out.push((s.emissions - prev.emissions) / dt);
      pend.push(s.pending);
      coal.push(s.emissions > 0 ? s.emission_uploads / s.emissions : null);
      [t, up, out, pend, coal].forEach(function (a) { if (a.length > KEEP) a.shift(); });
      rates.setData([t, up, out]);
      pending.setData([t, pend, coal]);
      document.body.dataset.points = t.length;
      prev = s;
    }
    var every = parseInt(ratesEl.getAttribute("data-poll-ms"), 10) || 2000;
    setInterval(function () {
      fetch("/ui/stats.json", { credentials: "same-origin" }).then(function (r) { return r.ok ? r.json() : null; }).then(function (s) { if (s) push(s); }).catch(function () {});
    }, every);
  }
  document.addEventListener("DOMContentLoaded", function () {
    localTimes(document);
    sortable(document);
    countdowns();
    setInterval(countdowns, 1000);
    charts();
  });
  document.addEventListener("htmx:afterSettle", function () { localTimes(document); countdowns(); });
})();
