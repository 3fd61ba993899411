// Refresh the overview every few seconds: fetch /fragment (server-rendered) and put it in place, unless the
// operator is choosing something in it (a select open, a field focused). A lost session goes back to the login.
// The X-Console-Refresh header tells the console this fetch is not the operator's: it keeps no session alive.
(function () {
  "use strict";
  var overview = document.getElementById("overview");
  if (!overview) { return; }
  var every = parseInt(overview.getAttribute("data-refresh-ms"), 10) || 2000;
  function busy() {
    var a = document.activeElement;
    return a && overview.contains(a) && (a.tagName === "SELECT" || a.tagName === "INPUT");
  }
  function refresh() {
    if (busy()) { setTimeout(refresh, every); return; }
    fetch("/fragment", {credentials: "same-origin", cache: "no-store",
                        headers: {"X-Console-Refresh": "auto"}}).then(function (r) {
      if (r.status === 401) { window.location.assign("/login"); return null; }
      return r.ok ? r.text() : null;
    }).then(function (html) {
      if (html !== null && !busy()) { overview.innerHTML = html; }
    }).catch(function () { /* the console is restarting: try again at the next turn */ })
      .then(function () { setTimeout(refresh, every); });
  }
  setTimeout(refresh, every);
}());
