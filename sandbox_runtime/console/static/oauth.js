// Signing in with the server's identity provider (when /console/config.json names one): the
// OAuth authorization code flow with PKCE (S256), run in this page. The provider sends the
// browser back to /console/callback with a code, which is exchanged for an access token at the
// provider's token endpoint (a public client: no secret here). The token is kept in this tab's
// sessionStorage only, and used as the Bearer for /mcp like a static token.

const PENDING = "srt-console-oauth";

// The console's sign-in settings: {issuer, client_id, resource, scope} or null (tokens only).
export async function oauthConfig() {
  const response = await fetch("/console/config.json", { cache: "no-store", credentials: "omit" });
  if (!response.ok) return { oauth: null, callback: "/console/callback" };
  return response.json();
}

// The issuer's metadata: OpenID discovery, else RFC 8414 (the path after the well-known part).
async function discover(issuer) {
  const base = issuer.replace(/\/$/, "");
  const url = new URL(issuer);
  const path = url.pathname.replace(/\/$/, "");
  const places = [
    `${base}/.well-known/openid-configuration`,
    `${url.origin}/.well-known/oauth-authorization-server${path}`,
  ];
  for (const place of places) {
    try {
      const response = await fetch(place, { cache: "no-store", credentials: "omit" });
      if (response.ok) {
        const metadata = await response.json();
        if (metadata.authorization_endpoint && metadata.token_endpoint) return metadata;
      }
    } catch {
      /* the next place */
    }
  }
  throw new Error(`cannot read the identity provider's metadata at ${places[0]}`);
}

function base64url(bytes) {
  let text = "";
  for (const b of new Uint8Array(bytes)) text += String.fromCharCode(b);
  return btoa(text).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function randomText(size) {
  return base64url(crypto.getRandomValues(new Uint8Array(size)));
}

// Off to the provider's sign-in; the page comes back at the callback (finishSignIn).
export async function startSignIn(config, callback, session) {
  const metadata = await discover(config.issuer);
  const verifier = randomText(48);
  const challenge = base64url(
    await crypto.subtle.digest("SHA-256", new TextEncoder().encode(verifier)),
  );
  const state = randomText(24);
  const redirect = new URL(callback, window.location.origin).href;
  sessionStorage.setItem(
    PENDING,
    JSON.stringify({
      verifier,
      state,
      session,
      redirect,
      issuer: metadata.issuer || config.issuer,
      token_endpoint: metadata.token_endpoint,
    }),
  );
  const url = new URL(metadata.authorization_endpoint);
  const params = {
    response_type: "code",
    client_id: config.client_id,
    redirect_uri: redirect,
    scope: config.scope,
    state,
    code_challenge: challenge,
    code_challenge_method: "S256",
    resource: config.resource,
  };
  for (const [name, value] of Object.entries(params)) url.searchParams.set(name, value);
  window.location.assign(url.href);
}

// Whether this page is the provider's answer (the callback path with a code or an error).
export function isCallback(callback) {
  const here = new URL(window.location.href);
  return here.pathname === callback && (here.searchParams.has("code") || here.searchParams.has("error"));
}

// The provider's answer, exchanged for {token, session}; Error saying what went wrong.
export async function finishSignIn(config) {
  const here = new URL(window.location.href);
  window.history.replaceState(null, "", "/"); // the code is single-use: off the address bar
  const pending = JSON.parse(sessionStorage.getItem(PENDING) || "null");
  sessionStorage.removeItem(PENDING);
  if (!pending) throw new Error("this sign-in was not started here (or was already finished)");
  const error = here.searchParams.get("error");
  if (error) {
    const about = here.searchParams.get("error_description") || "";
    throw new Error(`the identity provider refused: ${error}${about ? `: ${about}` : ""}`);
  }
  if (here.searchParams.get("state") !== pending.state) {
    throw new Error("the sign-in's state does not match (a stale or forged answer)");
  }
  const iss = here.searchParams.get("iss"); // RFC 9207: the answer names its issuer
  if (iss && iss.replace(/\/$/, "") !== pending.issuer.replace(/\/$/, "")) {
    throw new Error(`the answer came from another issuer (${iss})`);
  }
  const body = new URLSearchParams({
    grant_type: "authorization_code",
    code: here.searchParams.get("code"),
    redirect_uri: pending.redirect,
    client_id: config.client_id,
    code_verifier: pending.verifier,
    resource: config.resource,
  });
  const response = await fetch(pending.token_endpoint, {
    method: "POST",
    headers: { "Content-Type": "application/x-www-form-urlencoded", Accept: "application/json" },
    body,
    credentials: "omit",
    cache: "no-store",
  });
  const answer = await response.json().catch(() => ({}));
  if (!response.ok || !answer.access_token) {
    const about = answer.error_description || answer.error || `HTTP ${response.status}`;
    throw new Error(`the identity provider did not give a token: ${about}`);
  }
  return { token: answer.access_token, session: pending.session };
}
