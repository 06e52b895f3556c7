// /docs: Swagger UI over this service's own /openapi.json, with every asset from the package
// (the page's CSP allows scripts from this service only, so no inline set-up script).
"use strict";

// A request without a key of its own ("Authorize") goes with the dashboard session this
// browser may hold: the session is accepted only with this header, which says the request
// comes from one of the service's own pages (and only scripts of this origin can add it).
function withSession(request) {
  const headers = request.headers || {};
  const keyed = Object.keys(headers).some((name) => name.toLowerCase() === "authorization");
  if (!keyed) headers["X-Corral-UI"] = "1";
  request.headers = headers;
  return request;
}

window.addEventListener("DOMContentLoaded", () => {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    // No validator badge: Swagger UI would fetch it from validator.swagger.io.
    validatorUrl: null,
    // The spec is this service's: never one named in the page's query string.
    queryConfigEnabled: false,
    requestInterceptor: withSession,
    presets: [SwaggerUIBundle.presets.apis],
  });
});
