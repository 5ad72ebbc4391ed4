// The admin UI's few scripts: upload with progress, confirmations, the playground's
// adapter filter, copying a new key. Every page works without them except the upload.
"use strict";

(function () {
  const csrfToken = () => {
    const meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.content : "";
  };

  const announce = (message) => {
    const status = document.getElementById("status");
    if (status) status.textContent = message;
  };

  // Destructive forms ask first.
  document.addEventListener("submit", (event) => {
    const form = event.target;
    if (form instanceof HTMLFormElement && form.dataset.confirm && !window.confirm(form.dataset.confirm)) {
      event.preventDefault();
    }
  });

  // Copy a newly created key.
  document.addEventListener("click", (event) => {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    const field = document.getElementById(button.dataset.copy);
    field.select();
    const done = () => announce("Key copied to the clipboard.");
    if (navigator.clipboard) {
      navigator.clipboard.writeText(field.value).then(done, () => announce("Select the key and copy it."));
    } else {
      announce("Select the key and copy it.");
    }
  });

  // Playground: offer only the adapters the chosen tenant can use.
  const tenant = document.getElementById("pg-tenant");
  const adapter = document.getElementById("pg-adapter");
  if (tenant && adapter) {
    const filter = () => {
      for (const option of adapter.options) {
        const owner = option.dataset.owner;
        const usable = !owner || owner === "shared" || owner === tenant.value;
        option.hidden = !usable;
        option.disabled = !usable;
        if (!usable && option.selected) adapter.value = "";
      }
    };
    tenant.addEventListener("change", filter);
    filter();
  }

  // Adapter upload: streamed with XMLHttpRequest for its progress events.
  const form = document.getElementById("upload-form");
  if (form) {
    const box = document.getElementById("upload-progress-box");
    const bar = document.getElementById("upload-progress");
    const text = document.getElementById("upload-progress-text");
    const button = document.getElementById("upload-button");
    const report = document.getElementById("upload-report");
    const facts = document.getElementById("upload-report-facts");
    const link = document.getElementById("upload-report-link");

    const showProgress = (percent, label) => {
      bar.value = percent;
      bar.textContent = `${percent}%`;
      text.textContent = label || `${percent}%`;
    };

    const fact = (term, value) => {
      const dt = document.createElement("dt");
      dt.textContent = term;
      const dd = document.createElement("dd");
      dd.textContent = value;
      facts.append(dt, dd);
    };

    const refreshList = async () => {
      const response = await fetch(window.location.pathname, { headers: { Accept: "text/html" } });
      if (!response.ok) return;
      const page = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = page.getElementById("adapters-list");
      if (fresh) document.getElementById("adapters-list").replaceWith(fresh);
    };

    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const data = new FormData(form);
      const request = new XMLHttpRequest();
      request.open("POST", form.action);
      request.setRequestHeader("X-CSRF-Token", csrfToken());
      request.setRequestHeader("Accept", "application/json");
      request.upload.onprogress = (e) => {
        if (e.lengthComputable) showProgress(Math.round((100 * e.loaded) / e.total));
      };
      request.upload.onload = () => showProgress(100, "Uploaded; validating…");
      request.onload = () => {
        button.disabled = false;
        let body = null;
        try { body = JSON.parse(request.responseText); } catch (e) { body = null; }
        facts.replaceChildren();
        if (request.status === 201 && body) {
          const r = body.report || {};
          fact("Adapter", `${body.name} version ${body.version}`);
          fact("Status", body.status);
          fact("Rank", String(r.rank ?? "-"));
          fact("Alpha", String(r.alpha ?? "-"));
          fact("Target modules", (r.target_modules || []).join(", ") || "-");
          fact("Size", `${r.size_bytes ?? "-"} bytes`);
          link.href = `${form.action.replace(/\/upload$/, "")}/${body.id}`;
          link.hidden = false;
          report.hidden = false;
          announce(`Adapter ${body.name} version ${body.version} is ${body.status}.`);
          form.reset();
          refreshList();
        } else {
          const message = body && body.error ? body.error.message : `Upload failed (HTTP ${request.status}).`;
          fact("Status", "refused");
          fact("Reason", message);
          link.hidden = true;
          report.hidden = false;
          announce(`Upload failed: ${message}`);
        }
        report.focus();
      };
      request.onerror = () => {
        button.disabled = false;
        announce("Upload failed: the connection was lost.");
      };
      box.hidden = false;
      showProgress(0, "Starting…");
      button.disabled = true;
      announce("Uploading…");
      request.send(data);
    });
  }
})();
