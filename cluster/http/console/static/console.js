// opgraph console: the little JavaScript the pages use (no build step). The pages work without it;
// with it, a node opens in the side panel, controls ask and post, and a live run updates in place.
(function () {
  "use strict";
  var ICONS = {pending: "○", queued: "◔", running: "▶", completed: "✓", failed: "✗", skipped: "↷", cancelled: "■"};
  var STATES = Object.keys(ICONS);
  var BAR_ORDER = ["completed", "running", "queued", "failed", "cancelled", "skipped", "pending"];
  function csrf() { var m = document.querySelector('meta[name="csrf-token"]'); return m ? m.content : ""; }
  function setState(el, state) {
    STATES.forEach(function (s) { el.classList.remove("s-" + s); });
    el.classList.add("s-" + state);
  }

  // -- the runs list: j/k to move, Enter to open; statuses kept live --------------------------
  function runsList(table) {
    var rows = Array.prototype.slice.call(table.querySelectorAll("tbody tr[data-run]"));
    var at = -1;
    function select(i) {
      if (!rows.length) return;
      at = Math.max(0, Math.min(rows.length - 1, i));
      rows.forEach(function (r) { r.classList.remove("selected"); });
      rows[at].classList.add("selected");
      rows[at].querySelector("a.run-link").focus();
    }
    document.addEventListener("keydown", function (e) {
      if (e.target.tagName === "INPUT" || e.target.tagName === "SELECT") return;
      if (e.key === "j") { select(at + 1); e.preventDefault(); }
      else if (e.key === "k") { select(at - 1); e.preventDefault(); }
    });
    function poll() {
      fetch("/api/runs?" + table.dataset.live, {headers: {Accept: "application/json"}, credentials: "same-origin"})
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (body) {
          if (!body) return;
          body.runs.forEach(function (run) {
            var row = table.querySelector('tr[data-run="' + CSS.escape(run.run_id) + '"]');
            if (!row) return;
            var badge = row.querySelector("[data-status]");
            var state = run.status === "admitted" ? "queued" : (run.status === "running" ? "running" : run.status);
            setState(badge, state);
            badge.textContent = (ICONS[state] || "") + " " + run.status;
          });
        }).catch(function () {});
    }
    if (table.querySelector('tr[data-run] .s-running, tr[data-run] .s-queued')) setInterval(poll, 3000);
  }

  // -- the run page ------------------------------------------------------------------------------
  function runPage(head) {
    var runId = head.dataset.run;
    var panel = document.getElementById("panel");
    var canvas = document.getElementById("canvas");
    var opener = null;
    function open(url, from) {
      opener = from || opener;
      fetch(url, {headers: {"X-Console-Fragment": "1"}, credentials: "same-origin"})
        .then(function (r) { return r.text(); })
        .then(function (html) {
          panel.innerHTML = html;  // the server's own escaped fragment
          panel.hidden = false;
          panel.focus();
        });
    }
    function close() {
      panel.hidden = true; panel.innerHTML = "";
      document.querySelectorAll(".shape.active").forEach(function (s) { s.classList.remove("active"); });
      if (opener) opener.focus();
    }
    canvas.addEventListener("click", function (e) {
      var shape = e.target.closest(".shape");
      if (!shape) return;
      e.preventDefault();
      document.querySelectorAll(".shape.active").forEach(function (s) { s.classList.remove("active"); });
      shape.classList.add("active");
      open(shape.getAttribute("href"), shape);
    });
    panel.addEventListener("click", function (e) {
      if (e.target.closest("[data-close]")) { close(); return; }
      var link = e.target.closest("a[data-node-link], a[data-panel-link]");
      if (link) { e.preventDefault(); open(link.getAttribute("href")); }
    });
    document.addEventListener("keydown", function (e) { if (e.key === "Escape" && !panel.hidden) close(); });

    var outcome = document.getElementById("control-outcome");
    document.querySelectorAll("button.control").forEach(function (button) {
      button.addEventListener("click", function () {
        var body = {};
        if (button.dataset.message) {
          var text = window.prompt("Message to send into the run:");
          if (text === null) return;
          body.text = text;
        } else if (!window.confirm(button.dataset.confirm)) { return; }
        outcome.textContent = button.dataset.action + "…";
        fetch("/api/runs/" + encodeURIComponent(runId) + "/" + button.dataset.action, {
          method: "POST", credentials: "same-origin",
          headers: {"Content-Type": "application/json", "X-CSRF-Token": csrf()},
          body: JSON.stringify(body)
        }).then(function (r) {
          return r.json().then(function (answer) {
            if (r.ok) {
              outcome.textContent = button.dataset.action + ": " + (answer.status || (answer.accepted ? "accepted" : "not accepted"));
            } else {
              outcome.textContent = button.dataset.action + " refused (" + r.status + "): " + (answer.error || "");
            }
          });
        }).catch(function (err) { outcome.textContent = button.dataset.action + " failed: " + err; });
      });
    });

    if (head.dataset.live !== "yes" || !window.EventSource) return;
    var updates = window.opgraphUpdates = [];  // [shape id, when applied(, counts)]: what the benchmark reads
    var source = new EventSource("/runs/" + encodeURIComponent(runId) + "/live");
    source.onmessage = function (message) {
      var update = JSON.parse(message.data);
      var nodes = update.nodes || {};
      Object.keys(nodes).forEach(function (id) {
        var el = document.getElementById("n-" + id);
        if (!el) return;
        setState(el, nodes[id]);
        var icon = el.querySelector(".icon");
        if (icon) icon.textContent = ICONS[nodes[id]] || "";
        el.setAttribute("data-state", nodes[id]);
        updates.push([id, Date.now()]);
      });
      var groups = update.groups || {};
      Object.keys(groups).forEach(function (id) {
        updates.push([id, Date.now(), groups[id][2]]);
        var el = document.getElementById(id);
        if (!el) return;
        setState(el, groups[id][0]);
        var counts = el.querySelector(".counts");
        if (counts) counts.textContent = groups[id][1];
        var bar = el.querySelector(".bar"), byState = groups[id][2] || {};
        if (bar) {
          var total = 0, x = parseFloat(bar.dataset.x), width = parseFloat(bar.dataset.width);
          Object.keys(byState).forEach(function (s) { total += byState[s]; });
          BAR_ORDER.forEach(function (s) {
            var seg = bar.querySelector(".seg-" + s), part = total ? width * (byState[s] || 0) / total : 0;
            seg.setAttribute("x", x.toFixed(1)); seg.setAttribute("width", part.toFixed(1)); x += part;
          });
        }
      });
      if (update.run) {
        var badge = document.getElementById("run-status");
        setState(badge, update.run.state);
        badge.textContent = (ICONS[update.run.state] || "") + " " + update.run.status;
        if (update.run.counts) document.getElementById("run-counts").textContent = update.run.counts;
      }
      if (update.done) source.close();
    };
  }

  document.addEventListener("DOMContentLoaded", function () {
    var table = document.getElementById("runs");
    if (table) runsList(table);
    var head = document.getElementById("run");
    if (head) runPage(head);
  });
})();
