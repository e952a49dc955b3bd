// A real OpenID provider for the OAuth tests (tests/oidc_harness.py starts it): the certified
// `oidc-provider` package with the tests' users and groups, dynamic client registration, PKCE
// required, resource indicators (RFC 8707: access tokens are JWTs whose `aud` is the resource
// asked for), introspection and revocation (opaque tokens for the client `srt-opaque`), and
// routes only a test provider has: a scripted login, key rotation and minting bad tokens.
//
//   node provider.mjs --port N [--max-seconds S]
//
// Prints one line `{"issuer": ...}` on stdout once it listens. Exits by itself after
// --max-seconds (default 1800) so a test run that dies cannot leave it running.
//
// Test-only routes (never in a real provider):
//   GET  /interaction/:uid?as=USER  the login and consent pages, answered at once for USER
//   POST /admin/rotate              a new signing key, made current (the old one still listed)
//   POST /admin/mint {claims, key}  a JWT access token with `claims` over sane defaults,
//                                   signed by the current key, key:"unknown" (a key the
//                                   provider never published) or key:"none" (alg none)

import { createHash, createSign, generateKeyPairSync, randomUUID } from "node:crypto";
import { createServer } from "node:http";
import { parseArgs } from "node:util";

import Provider from "oidc-provider";

const { values: args } = parseArgs({
  options: {
    port: { type: "string" },
    "max-seconds": { type: "string", default: "1800" },
  },
});
const port = Number(args.port);
const issuer = `http://127.0.0.1:${port}`;

// The users and their groups; the groups claim is in every access token (and introspection).
const USERS = {
  alice: { groups: ["engineers"], email: "alice@example.com" },
  carol: { groups: ["engineers"], email: "carol@example.com" },
  bob: { groups: ["viewers"], email: "bob@example.com" },
};
// Machine clients (client credentials): their groups.
const MACHINES = {
  "srt-machine": ["engineers"],
  "srt-opaque": ["engineers"],
};
const RESOURCE_SCOPES = "sandbox:execute sandbox:files snapshots";
export const INTROSPECTOR = { id: "srt-introspect", secret: "introspect-secret-0123456789" };

function newKey() {
  const { privateKey } = generateKeyPairSync("rsa", { modulusLength: 2048 });
  const jwk = privateKey.export({ format: "jwk" });
  jwk.kid = createHash("sha256").update(jwk.n).digest("base64url").slice(0, 16);
  jwk.alg = "RS256";
  jwk.use = "sig";
  return { jwk, privateKey };
}

let keys = [newKey()]; // the first one signs
const unknownKey = newKey(); // never published

function makeProvider() {
  const provider = new Provider(issuer, {
    jwks: { keys: keys.map((k) => k.jwk) },
    clients: [
      {
        client_id: INTROSPECTOR.id,
        client_secret: INTROSPECTOR.secret,
        token_endpoint_auth_method: "client_secret_basic",
        grant_types: [],
        response_types: [],
        redirect_uris: [],
      },
      ...Object.keys(MACHINES).map((id) => ({
        client_id: id,
        client_secret: `${id}-secret-0123456789`,
        token_endpoint_auth_method: "client_secret_basic",
        grant_types: ["client_credentials"],
        response_types: [],
        redirect_uris: [],
        scope: RESOURCE_SCOPES,
      })),
    ],
    findAccount: async (ctx, sub) =>
      USERS[sub] && {
        accountId: sub,
        claims: async () => ({ sub, email: USERS[sub].email, groups: USERS[sub].groups }),
      },
    claims: { openid: ["sub"], email: ["email"], groups: ["groups"] },
    scopes: ["openid", "offline_access", "email", ...RESOURCE_SCOPES.split(" ")],
    pkce: { required: () => true },
    features: {
      devInteractions: { enabled: false },
      registration: { enabled: true },
      clientCredentials: { enabled: true },
      introspection: {
        enabled: true,
        allowedPolicy: async (ctx, client) => client.clientId === INTROSPECTOR.id,
      },
      revocation: { enabled: true },
      resourceIndicators: {
        enabled: true,
        // A client that names no resource gets a token for none: the server refuses it.
        defaultResource: async () => undefined,
        useGrantedResource: async () => true,
        getResourceServerInfo: async (ctx, resourceIndicator, client) => ({
          scope: RESOURCE_SCOPES,
          audience: resourceIndicator,
          accessTokenTTL: 600,
          accessTokenFormat: client.clientId === "srt-opaque" ? "opaque" : "jwt",
          jwt: { sign: { alg: "RS256" } },
        }),
      },
    },
    extraTokenClaims: async (ctx, token) => {
      if (token.kind !== "AccessToken" && token.kind !== "ClientCredentials") return undefined;
      if (token.accountId) return { groups: USERS[token.accountId]?.groups || [] };
      // A machine's token names the client as its subject (RFC 9068), in introspection too.
      return { groups: MACHINES[token.clientId] || [], sub: token.clientId };
    },
    interactions: { url: (ctx, interaction) => `/interaction/${interaction.uid}` },
    ttl: {
      AccessToken: 600,
      ClientCredentials: 600,
      AuthorizationCode: 60,
      Grant: 3600,
      IdToken: 600,
      Interaction: 600,
      Session: 3600,
      RefreshToken: 3600,
    },
    // The tests' clients are local programs on loopback redirect URIs.
    clientDefaults: { token_endpoint_auth_method: "none" },
    cookies: { keys: ["test-cookie-key-0123456789"] },
  });
  provider.proxy = false;
  return provider;
}

let provider = makeProvider();

// --- the test-only routes --------------------------------------------------------------------

function b64(value) {
  return Buffer.from(typeof value === "string" ? value : JSON.stringify(value)).toString(
    "base64url",
  );
}

function mint({ claims = {}, key = "current" }) {
  const now = Math.floor(Date.now() / 1000);
  const payload = {
    iss: issuer,
    sub: "alice",
    client_id: "srt-minted",
    iat: now,
    exp: now + 300,
    jti: randomUUID(),
    scope: RESOURCE_SCOPES,
    groups: USERS.alice.groups,
    ...claims,
  };
  for (const [name, value] of Object.entries(payload)) if (value === null) delete payload[name];
  if (key === "none") return `${b64({ alg: "none", typ: "at+jwt" })}.${b64(payload)}.`;
  const signer = key === "unknown" ? unknownKey : keys[0];
  const head = b64({ alg: "RS256", typ: "at+jwt", kid: signer.jwk.kid });
  const input = `${head}.${b64(payload)}`;
  const signature = createSign("RSA-SHA256").update(input).sign(signer.privateKey, "base64url");
  return `${input}.${signature}`;
}

async function interaction(req, res, user) {
  if (!USERS[user]) {
    res.writeHead(400, { "content-type": "text/plain" });
    res.end(`say who signs in: ?as=${Object.keys(USERS).join("|")}`);
    return;
  }
  const details = await provider.interactionDetails(req, res);
  const { prompt, params, session } = details;
  if (prompt.name === "login") {
    await provider.interactionFinished(req, res, { login: { accountId: user } }, {
      mergeWithLastSubmission: false,
    });
    return;
  }
  const grant = details.grantId
    ? await provider.Grant.find(details.grantId)
    : new provider.Grant({ accountId: session.accountId, clientId: params.client_id });
  const missing = prompt.details;
  if (missing.missingOIDCScope) grant.addOIDCScope(missing.missingOIDCScope.join(" "));
  if (missing.missingOIDCClaims) grant.addOIDCClaims(missing.missingOIDCClaims);
  for (const [indicator, scopes] of Object.entries(missing.missingResourceScopes || {})) {
    grant.addResourceScope(indicator, scopes.join(" "));
  }
  const grantId = await grant.save();
  await provider.interactionFinished(req, res, { consent: { grantId } }, {
    mergeWithLastSubmission: true,
  });
}

function readJson(req) {
  return new Promise((resolve, reject) => {
    let body = "";
    req.on("data", (chunk) => {
      body += chunk;
      if (body.length > 65536) reject(new Error("body too large"));
    });
    req.on("end", () => {
      try {
        resolve(body ? JSON.parse(body) : {});
      } catch (err) {
        reject(err);
      }
    });
  });
}

function json(res, status, value) {
  res.writeHead(status, { "content-type": "application/json" });
  res.end(JSON.stringify(value));
}

const server = createServer(async (req, res) => {
  const url = new URL(req.url, issuer);
  try {
    const match = url.pathname.match(/^\/interaction\/([^/]+)$/);
    if (match && req.method === "GET") {
      await interaction(req, res, url.searchParams.get("as"));
      return;
    }
    if (url.pathname === "/admin/rotate" && req.method === "POST") {
      keys = [newKey(), ...keys];
      provider = makeProvider(); // (the memory adapter's store is shared: clients, grants stay)
      json(res, 200, { kid: keys[0].jwk.kid, kids: keys.map((k) => k.jwk.kid) });
      return;
    }
    if (url.pathname === "/admin/mint" && req.method === "POST") {
      json(res, 200, { token: mint(await readJson(req)) });
      return;
    }
  } catch (err) {
    json(res, 500, { error: String(err && err.stack ? err.stack : err) });
    return;
  }
  provider.callback()(req, res);
});

server.listen(port, "127.0.0.1", () => {
  process.stdout.write(`${JSON.stringify({ issuer, introspector: INTROSPECTOR })}\n`);
});
setTimeout(() => process.exit(0), Number(args["max-seconds"]) * 1000).unref();
for (const signal of ["SIGTERM", "SIGINT"]) process.on(signal, () => process.exit(0));
