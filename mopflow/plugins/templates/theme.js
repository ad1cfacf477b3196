// Inside Airflow's UI (a same-origin iframe) the page takes the UI's colour mode, which Airflow
// keeps as the class "light" or "dark" on its <html> (next-themes), and follows its toggle. On its
// own, or when the parent cannot be read, the CSS follows prefers-color-scheme.
(function () {
  var root = document.documentElement;
  function parentRoot() {
    try {
      return window.parent !== window ? window.parent.document.documentElement : null;
    } catch (e) {
      return null; // another origin
    }
  }
  function apply() {
    var outer = parentRoot();
    var mode = null;
    if (outer) {
      if (outer.classList.contains("dark")) mode = "dark";
      else if (outer.classList.contains("light")) mode = "light";
      else mode = outer.getAttribute("data-theme");
    }
    if (mode === "dark" || mode === "light") root.setAttribute("data-theme", mode);
    else root.removeAttribute("data-theme");
  }
  apply();
  var outer = parentRoot();
  if (outer && window.MutationObserver) {
    new MutationObserver(apply).observe(outer, {attributes: true, attributeFilter: ["class", "data-theme"]});
  }
  window.mopflowTheme = apply;
})();
