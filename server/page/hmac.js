// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104) for the coordinator's page, which proves it
// holds the coordinator's token without sending it (server/_page_access.py). The page cannot use
// the browser's crypto.subtle: it exists only in secure contexts (https, localhost), and a
// coordinator's HTTP port is plain http on a cluster node. Small inputs only (a nonce), so
// plainness beats speed here. No imports; tests/unit/test_page_hmac.py checks it against
// Python's hmac in a real browser (and under node when there is one).
"use strict";

(function (root) {
  // FIPS 180-4 §4.2.2: the first 32 bits of the fractional parts of the cube roots of the
  // first 64 primes; §5.3.3: of the square roots of the first 8 primes.
  const K = new Uint32Array([
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
  ]);
  const H0 = [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];
  const BLOCK = 64; // bytes

  function rotr(x, n) {
    return (x >>> n) | (x << (32 - n));
  }

  // The message, a 1 bit, zeros, and its length in bits as a 64-bit big-endian number, filling
  // whole blocks.
  function pad(data) {
    const blocks = Math.ceil((data.length + 9) / BLOCK);
    const out = new Uint8Array(blocks * BLOCK);
    out.set(data);
    out[data.length] = 0x80;
    const view = new DataView(out.buffer);
    view.setUint32(out.length - 8, Math.floor(data.length / 0x20000000)); // bits / 2^32
    view.setUint32(out.length - 4, (data.length << 3) >>> 0); // bits mod 2^32
    return view;
  }

  function sha256(data) {
    const view = pad(data);
    const h = Uint32Array.from(H0);
    const w = new Uint32Array(64);
    for (let offset = 0; offset < view.byteLength; offset += BLOCK) {
      for (let t = 0; t < 16; t++) {
        w[t] = view.getUint32(offset + 4 * t);
      }
      for (let t = 16; t < 64; t++) {
        const x = w[t - 15];
        const y = w[t - 2];
        const s0 = rotr(x, 7) ^ rotr(x, 18) ^ (x >>> 3);
        const s1 = rotr(y, 17) ^ rotr(y, 19) ^ (y >>> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1; // a Uint32Array keeps the sum mod 2^32
      }
      let a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
      for (let t = 0; t < 64; t++) {
        const sum1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
        const choose = (e & f) ^ (~e & g);
        const t1 = (k + sum1 + choose + K[t] + w[t]) >>> 0;
        const sum0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
        const majority = (a & b) ^ (a & c) ^ (b & c);
        const t2 = (sum0 + majority) >>> 0;
        k = g;
        g = f;
        f = e;
        e = (d + t1) >>> 0;
        d = c;
        c = b;
        b = a;
        a = (t1 + t2) >>> 0;
      }
      h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
    }
    const digest = new Uint8Array(32);
    const out = new DataView(digest.buffer);
    for (let i = 0; i < 8; i++) {
      out.setUint32(4 * i, h[i]);
    }
    return digest;
  }

  function hmacSha256(key, message) {
    const k = key.length > BLOCK ? sha256(key) : key;
    const padded = new Uint8Array(BLOCK);
    padded.set(k);
    const inner = new Uint8Array(BLOCK + message.length);
    const outer = new Uint8Array(BLOCK + 32);
    for (let i = 0; i < BLOCK; i++) {
      inner[i] = padded[i] ^ 0x36;
      outer[i] = padded[i] ^ 0x5c;
    }
    inner.set(message, BLOCK);
    outer.set(sha256(inner), BLOCK);
    return sha256(outer);
  }

  function hex(bytes) {
    let text = "";
    for (const byte of bytes) {
      text += byte.toString(16).padStart(2, "0");
    }
    return text;
  }

  function utf8(text) {
    return new TextEncoder().encode(text);
  }

  const api = Object.freeze({ sha256, hmacSha256, hex, utf8 });
  root.aiocollHmac = api;
  if (typeof module !== "undefined" && module.exports) {
    module.exports = api; // node, for tests
  }
})(typeof globalThis !== "undefined" ? globalThis : this);
