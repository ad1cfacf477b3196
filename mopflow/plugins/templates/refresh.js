// Every refresh_ms while a section is live (its pipeline run is RUNNING): fetch the page again and
// swap the section for its new version, figure URLs made unique so they are fetched anew.
(function () {
  async function refresh() {
    const live = document.querySelectorAll("section.sweep[data-live]");
    if (!live.length) return 0;
    const response = await fetch(location.href, {credentials: "same-origin", cache: "no-store"});
    if (!response.ok) return 0;
    const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
    const stamp = String(Date.now());
    let swapped = 0;
    for (const old of live) {
      const next = fresh.getElementById(old.id);
      if (!next) continue;
      for (const img of next.querySelectorAll("img.search-figure")) {
        img.setAttribute("src", img.getAttribute("src") + "?at=" + stamp);
      }
      old.replaceWith(document.importNode(next, true));
      swapped += 1;
    }
    return swapped;
  }
  window.mopflowRefresh = refresh;
  setInterval(function () { refresh().catch(function () {}); }, {{ refresh_ms|int }});
})();
