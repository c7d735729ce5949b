'use strict';
// A Node.js client of rollout.v1.RolloutService, written the way a trainer in another language
// would write one: load proto/rollout.proto at run time with @grpc/proto-loader and call the
// service with @grpc/grpc-js. No generated code and nothing from the Python package.
//
// Usage: node client.js PLAN.json
//
// PLAN.json names the proto folder, the prompt and, per scenario, the server address to use:
//   {"proto_dir": ".../proto", "prompt": [1, 2, ...],
//    "server_info": {"target": "127.0.0.1:1234"},
//    "stream": {"target": ..., "max_new_tokens": 32, "stream_batch_tokens": 8},
//    "invalid": {"target": ...},
//    "abort_by_id": {"target": ..., "continue_tokens": 5}, "abort_all": {"target": ...},
//    "render": {"target": ..., "png_path": "/tmp/x.png"},
//    "auth": {"target": ..., "trainer_token": "...", "admin_token": "..."},
//    "routed_experts": [{"name": "uint8", "target": ..., "max_new_tokens": 12}, ...],
//    "update_weights": {"target": ..., "checkpoint": "/dir/v1", "outside": "/etc"}}
// Scenarios that the plan leaves out are not run.
//
// It prints one JSON document on stdout with what it saw (facts, not verdicts): the Python test
// (test_node_client.py) makes the assertions. Any unexpected failure prints {"fatal": ...} and
// exits with status 1.

const crypto = require('node:crypto');
const fs = require('node:fs');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const plan = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));

// The options every reader of the contract should use (docs/api.md, "TypeScript"): field names as in
// the proto, int64 as decimal strings (no precision loss), enums as their names, unset fields
// filled with defaults, and the name of the set member of every oneof.
// The path is relative to includeDirs, otherwise proto-loader cannot resolve it cleanly.
const LOADER_OPTIONS = {
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [plan.proto_dir],
};
const packageDefinition = protoLoader.loadSync('rollout.proto', LOADER_OPTIONS);
const rolloutV1 = grpc.loadPackageDefinition(packageDefinition).rollout.v1;
const GENERATE = packageDefinition['rollout.v1.RolloutService'].Generate;

const DEADLINE_MS = 60000; // every call gets a deadline, so nothing here can hang for ever
const CHANNEL_OPTIONS = {'grpc.max_receive_message_length': 64 * 1024 * 1024};

const clients = new Map();
function client(target) {
  // One channel per server address, shared by the scenarios that use it.
  if (!clients.has(target)) {
    clients.set(target, new rolloutV1.RolloutService(target, grpc.credentials.createInsecure(), CHANNEL_OPTIONS));
  }
  return clients.get(target);
}

function deadline() {
  return new Date(Date.now() + DEADLINE_MS);
}

function unary(target, method, request) {
  return new Promise((resolve, reject) => {
    client(target)[method](request, {deadline: deadline()}, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

// Runs one Generate call and collects the stream. `onDelta(delta, index)` is called for every
// delta as it arrives (the abort scenarios use the first one as "the generation is in flight").
// Resolves once the call has both ended and reported its status, so no message is missed.
function generate(target, request, onDelta) {
  return new Promise((resolve) => {
    const call = client(target).Generate(request, {deadline: deadline()});
    const result = {deltas: [], sample: null, messages_after_sample: 0, header_request_id: null, code: null, details: null, status_details_b64: null};
    let ended = false;
    let status = null;
    const finish = () => {
      if (status !== null && (ended || status.code !== grpc.status.OK)) resolve(result);
    };
    call.on('metadata', (md) => {
      const v = md.get('x-request-id');
      result.header_request_id = v.length ? String(v[0]) : null;
    });
    call.on('data', (message) => {
      if (result.sample !== null) result.messages_after_sample += 1;
      if (message.event === 'delta') {
        result.deltas.push(message.delta);
        if (onDelta) onDelta(message.delta, result.deltas.length - 1);
      } else if (message.event === 'sample') {
        result.sample = message.sample;
      }
    });
    call.on('end', () => { ended = true; finish(); });
    call.on('error', () => {}); // the status event below carries the same code and details
    call.on('status', (s) => {
      status = s;
      result.code = grpc.status[s.code];
      result.details = s.details;
      const bin = s.metadata ? s.metadata.get('grpc-status-details-bin') : [];
      result.status_details_b64 = bin.length ? Buffer.from(bin[0]).toString('base64') : null;
      finish();
    });
  });
}

// The fields of a final sample the Python side checks (everything but the large routed experts).
function summary(sample) {
  if (sample === null) return null;
  return {
    index: sample.index,
    group_index: sample.group_index,
    session_id: sample.session_id,
    tokens: sample.tokens,
    response: sample.response,
    response_length: sample.response_length,
    loss_mask: sample.loss_mask,
    rollout_log_probs: sample.rollout_log_probs,
    status: sample.status,
    finish_reason: sample.finish_reason,
    failure_reason: sample.failure_reason,
    weight_versions: sample.weight_versions,
    usage: sample.usage,
    metadata: sample.metadata,
    has_routed_experts: sample.routed_experts !== null,
    engine_attempts: sample.engine_attempts.map((a) => a.engine),
  };
}

function streamReport(r) {
  return {
    code: r.code,
    details: r.details,
    header_request_id: r.header_request_id,
    messages_after_sample: r.messages_after_sample,
    deltas: r.deltas.map((d) => ({offset: d.offset, token_ids: d.token_ids, logprobs: d.logprobs, text: d.text})),
    sample: summary(r.sample),
  };
}

function pendingSample(tokens, extra = {}) {
  return {tokens, status: 'SAMPLE_STATUS_PENDING', ...extra};
}

// ---------------------------------------------------------------------------------------- scenarios

async function serverInfo(cfg) {
  const info = await unary(cfg.target, 'GetServerInfo', {});
  return {
    version: info.version,
    engines: info.engines.map((e) => ({url: e.url, healthy: e.healthy, model: e.model})),
    paused: info.paused,
  };
}

// (a) Stream deltas then the final sample. Greedy with the time flush off, so the Python side can
// regenerate the very same sample and compare token for token.
async function stream(cfg) {
  const request = {
    request_id: 'node-stream-1',
    sample: pendingSample(plan.prompt, {
      index: '7', // int64 goes in as a decimal string, as it comes out with longs: String
      group_index: '3',
      session_id: 'node-session',
      metadata: {fields: {source: {stringValue: 'node'}, weight: {numberValue: 0.5}}},
    }),
    sampling_params: {temperature: 0, max_new_tokens: cfg.max_new_tokens, ignore_eos: true},
    options: {stream_batch_tokens: cfg.stream_batch_tokens, stream_batch_interval_ms: 0},
  };
  return streamReport(await generate(cfg.target, request));
}

// A contract violation comes back as INVALID_ARGUMENT with a google.rpc.Status in the
// grpc-status-details-bin trailer; Node passes the bytes on, Python decodes the BadRequest.
async function invalid(cfg) {
  const r = await generate(cfg.target, {
    sample: pendingSample([plan.prompt[0], -5, plan.prompt[1]]),
    sampling_params: {max_new_tokens: 4},
  });
  return {code: r.code, details: r.details, status_details_b64: r.status_details_b64, deltas: r.deltas.length, sample: summary(r.sample)};
}

function longRequest(requestId) {
  // Far more tokens than can be produced before the abort lands (the engine has a per-token delay).
  return {
    request_id: requestId,
    sample: pendingSample(plan.prompt),
    sampling_params: {temperature: 0, ignore_eos: true},
    options: {stream_batch_tokens: 4, stream_batch_interval_ms: 0},
  };
}

// Starts a long generation; `inFlight` resolves at its first delta.
function startLong(target, requestId) {
  let markInFlight;
  const inFlight = new Promise((resolve) => { markInFlight = resolve; });
  const done = generate(target, longRequest(requestId), (_delta, i) => { if (i === 0) markInFlight(); });
  return {inFlight, done};
}

// (b1) Abort one generation by its request id (plus an id that is not in flight), then send the
// ABORTED sample back to Generate: it continues with the remaining budget.
async function abortById(cfg) {
  const run = startLong(cfg.target, 'node-abort-1');
  await run.inFlight;
  const abort = await unary(cfg.target, 'Abort', {request_ids: {ids: ['node-abort-1', 'node-not-in-flight']}});
  const aborted = await run.done;
  const report = {abort: {aborted: abort.aborted, unknown_request_ids: abort.unknown_request_ids, engine_errors: abort.engine_errors}, stream: streamReport(aborted)};
  if (aborted.sample !== null) {
    // The decoded object goes back as is: the Node representation must survive the round trip.
    const budget = aborted.sample.response_length + cfg.continue_tokens;
    const cont = await generate(cfg.target, {
      sample: aborted.sample,
      sampling_params: {temperature: 0, max_new_tokens: budget, ignore_eos: true},
      options: {final_only: true},
    });
    report.continuation = {budget, ...streamReport(cont)};
  }
  return report;
}

// (b2) Abort every generation: both streams end with ABORTED samples, and the engines are resumed
// so the next generation completes.
async function abortAll(cfg) {
  const runs = [startLong(cfg.target, 'node-all-1'), startLong(cfg.target, 'node-all-2')];
  await Promise.all(runs.map((r) => r.inFlight));
  const abort = await unary(cfg.target, 'Abort', {all: true});
  const streams = await Promise.all(runs.map((r) => r.done));
  const after = await generate(cfg.target, {
    sample: pendingSample(plan.prompt),
    sampling_params: {temperature: 0, max_new_tokens: 4, ignore_eos: true},
  });
  return {
    abort: {aborted: abort.aborted, unknown_request_ids: abort.unknown_request_ids, engine_errors: abort.engine_errors},
    streams: streams.map(streamReport),
    after: streamReport(after),
  };
}

function featuresReport(features) {
  return features.modalities.map((m) => ({
    modality: m.modality,
    items: m.items.map((it) => ({
      mm_hash: it.mm_hash,
      offset: it.placeholder.offset,
      length: it.placeholder.length,
      placeholder_token_id: it.placeholder_token_id,
      kwargs_data_bytes: it.kwargs_data == null ? null : it.kwargs_data.length,
    })),
  }));
}

// (c) Render a chat with a PNG image (as bytes and as a data URL), then generate from the rendered
// prompt with its multimodal features attached.
async function render(cfg) {
  const png = fs.readFileSync(cfg.png_path);
  const chat = (image) => ({
    chat: {messages: [{role: 'user', content: [{text: 'What is in this picture?'}, {image}]}]},
    add_generation_prompt: true,
    session_id: 'node-render',
  });
  const fromBytes = await unary(cfg.target, 'Render', chat({data: png, mime_type: 'image/png'}));
  const fromUrl = await unary(cfg.target, 'Render', chat({data_url: 'data:image/png;base64,' + png.toString('base64')}));
  const gen = await generate(cfg.target, {
    sample: pendingSample(fromBytes.token_ids, {session_id: 'node-render', multimodal_features: fromBytes.features}),
    sampling_params: {temperature: 0, max_new_tokens: 6, ignore_eos: true},
    options: {final_only: true},
  });
  return {
    png_sha256: crypto.createHash('sha256').update(png).digest('hex'),
    bytes: {token_ids: fromBytes.token_ids, engine: fromBytes.engine, features: featuresReport(fromBytes.features)},
    data_url: {token_ids: fromUrl.token_ids, features: featuresReport(fromUrl.features)},
    generate: streamReport(gen),
  };
}

// dtype name -> [typed array constructor, bytes per element, DataView getter]. The wire format is
// little-endian whatever this machine is, so values are read through a DataView with
// littleEndian = true rather than by viewing the buffer in host byte order.
const DTYPES = {
  D_TYPE_UINT8: [Uint8Array, 1, 'getUint8'],
  D_TYPE_UINT16: [Uint16Array, 2, 'getUint16'],
  D_TYPE_INT32: [Int32Array, 4, 'getInt32'],
};

// Decodes a RoutedExperts message into a typed array and a [tokens, layers, topk] shape.
function routedExpertsArray(re) {
  const spec = DTYPES[re.dtype];
  if (!spec) throw new Error(`unknown routed experts dtype ${re.dtype}`);
  const [Ctor, size, getter] = spec;
  const shape = re.shape.map(Number); // int64 arrives as decimal strings
  const count = shape.reduce((a, b) => a * b, 1);
  if (re.data.length !== count * size) {
    throw new Error(`routed experts: ${re.data.length} bytes for shape ${shape} of ${re.dtype}`);
  }
  const view = new DataView(re.data.buffer, re.data.byteOffset, re.data.byteLength);
  const values = new Ctor(count);
  for (let i = 0; i < count; i++) values[i] = view[getter](i * size, true);
  return {values, shape};
}

// (d) Generate with return_routed_experts and decode the bytes. This call goes through a generic
// client that hands back the raw wire bytes of every message (decoded with the same proto-loader
// definition), so the Python side can decode the very bytes this script decoded and compare.
async function routedExperts(cfg) {
  const raw = new grpc.Client(cfg.target, grpc.credentials.createInsecure(), CHANNEL_OPTIONS);
  const request = {
    sample: pendingSample(plan.prompt),
    sampling_params: {temperature: 0, max_new_tokens: cfg.max_new_tokens, ignore_eos: true},
    options: {return_routed_experts: true},
  };
  const messages = await new Promise((resolve, reject) => {
    const out = [];
    const call = raw.makeServerStreamRequest(GENERATE.path, GENERATE.requestSerialize, (buf) => buf, request, {deadline: deadline()});
    call.on('data', (buf) => out.push(buf));
    call.on('error', reject);
    call.on('end', () => resolve(out));
  });
  raw.close();
  const lastBytes = messages[messages.length - 1];
  const sample = GENERATE.responseDeserialize(lastBytes).sample;
  const re = sample.routed_experts;
  const report = {name: cfg.name, messages: messages.length, sample: summary(sample), final_message_b64: lastBytes.toString('base64')};
  if (re === null) return report;
  const {values, shape} = routedExpertsArray(re);
  let sum = 0;
  let min = Infinity;
  let max = -Infinity;
  for (const v of values) {
    sum += v;
    if (v < min) min = v;
    if (v > max) max = v;
  }
  const [tokens, layers, topk] = shape;
  // Row i is position start + i; report the first and last rows to check C order on the Python side.
  const row = (i) => Array.from({length: layers}, (_, l) => Array.from(values.subarray((i * layers + l) * topk, (i * layers + l + 1) * topk)));
  return {
    ...report,
    routed_experts: {
      dtype: re.dtype,
      array_type: values.constructor.name,
      shape,
      start: re.start,
      byte_length: re.data.length,
      sum,
      min,
      max,
      sha256: crypto.createHash('sha256').update(re.data).digest('hex'),
      first_row: tokens > 0 ? row(0) : null,
      last_row: tokens > 0 ? row(tokens - 1) : null,
    },
  };
}

// Calls `method` with a bearer token (or none) and reports the outcome instead of throwing.
function unaryAs(target, token, method, request) {
  const metadata = new grpc.Metadata();
  if (token) metadata.add('authorization', 'Bearer ' + token);
  return new Promise((resolve) => {
    client(target)[method](request, metadata, {deadline: deadline()}, (err, response) =>
      resolve(err ? {code: grpc.status[err.code], details: err.details} : {code: 'OK', response}),
    );
  });
}

// (c) Authentication and roles as another language sees them: the token travels as
// `authorization: Bearer` metadata; a trainer sees no engine URL and may not Pause or Abort(all);
// the replica-internal forwarding flag is gone from AbortRequest.
async function auth(cfg) {
  const abortFields = packageDefinition['rollout.v1.AbortRequest'].type.field.map((f) => f.name);
  const anonymous = await unaryAs(cfg.target, null, 'GetServerInfo', {});
  const trainerInfo = await unaryAs(cfg.target, cfg.trainer_token, 'GetServerInfo', {});
  return {
    abort_request_fields: abortFields,
    replica_service: 'rollout.v1.ReplicaService' in packageDefinition,
    anonymous_info: anonymous.code,
    trainer_engine_urls: trainerInfo.code === 'OK' ? trainerInfo.response.engines.map((e) => e.url) : trainerInfo.code,
    trainer_pause: (await unaryAs(cfg.target, cfg.trainer_token, 'Pause', {mode: 'PAUSE_MODE_KEEP'})).code,
    trainer_abort_all: (await unaryAs(cfg.target, cfg.trainer_token, 'Abort', {all: true})).code,
    admin_pause: (await unaryAs(cfg.target, cfg.admin_token, 'Pause', {mode: 'PAUSE_MODE_KEEP'})).code,
    admin_resume: (await unaryAs(cfg.target, cfg.admin_token, 'Resume', {})).code,
  };
}

// (f) A rollout step: two prompt groups of two samples, keep-all. The stream carries group results
// and progress counters, and ends with exactly one summary.
function rolloutStep(cfg) {
  return new Promise((resolve) => {
    const request = {
      step_id: 'node-step',
      groups: [0, 1].map((g) => ({prompt: pendingSample(cfg.prompt, {index: 2 * g}), group_index: g})),
      n_samples_per_prompt: 2,
      sampling_params: {temperature: 1.0, max_new_tokens: 5, ignore_eos: true, seed: 11},
    };
    const call = client(cfg.target).RolloutStep(request, {deadline: deadline()});
    const result = {groups: [], progress: 0, summary: null, after_summary: 0, code: null};
    call.on('data', (message) => {
      if (result.summary !== null) result.after_summary += 1;
      if (message.event === 'group') {
        const g = message.group;
        result.groups.push({group_index: Number(g.group_index), outcome: g.outcome, samples: g.samples.map(summary)});
      } else if (message.event === 'progress') {
        result.progress += 1;
      } else if (message.event === 'summary') {
        result.summary = {accepted: message.summary.accepted, target_reached: message.summary.target_reached};
      }
    });
    call.on('error', () => {});
    call.on('status', (s) => { result.code = grpc.status[s.code]; resolve(result); });
  });
}

// (g) A weight update, as a trainer in another language drives it: UpdateWeights with a checkpoint
// directory and a version (pause KEEP), a refused path, then a seeded generation on the new weights.
async function updateWeights(cfg) {
  const request = (path, version) => ({
    checkpoint: {path},
    weight_version: version,
    pause_mode: 'PAUSE_MODE_KEEP',
  });
  const response = await unary(cfg.target, 'UpdateWeights', request(cfg.checkpoint, 'node-v1'));
  let refused = null;
  try {
    await unary(cfg.target, 'UpdateWeights', request(cfg.outside, 'node-v2'));
  } catch (err) {
    refused = {code: grpc.status[err.code], details: err.details};
  }
  const after = await generate(cfg.target, {
    sample: pendingSample(cfg.prompt),
    sampling_params: {temperature: 1.0, max_new_tokens: 4, ignore_eos: true, seed: 3},
  });
  return {
    weight_version: response.weight_version,
    engines: response.engines.map((e) => ({engine: e.engine, updated: e.updated, error: e.error})),
    previous_versions: response.previous_versions,
    refused,
    sample_versions: after.sample === null ? null : after.sample.weight_versions.map((w) => w.version),
  };
}

async function main() {
  const out = {node: process.version, grpc_js: require('@grpc/grpc-js/package.json').version, proto_loader: require('@grpc/proto-loader/package.json').version};
  if (plan.server_info) out.server_info = await serverInfo(plan.server_info);
  if (plan.stream) out.stream = await stream(plan.stream);
  if (plan.invalid) out.invalid = await invalid(plan.invalid);
  if (plan.abort_by_id) out.abort_by_id = await abortById(plan.abort_by_id);
  if (plan.abort_all) out.abort_all = await abortAll(plan.abort_all);
  if (plan.render) out.render = await render(plan.render);
  if (plan.auth) out.auth = await auth(plan.auth);
  if (plan.rollout_step) out.rollout_step = await rolloutStep(plan.rollout_step);
  if (plan.update_weights) out.update_weights = await updateWeights(plan.update_weights);
  if (plan.routed_experts) out.routed_experts = [];
  for (const cfg of plan.routed_experts || []) out.routed_experts.push(await routedExperts(cfg));
  return out;
}

main().then(
  (out) => {
    process.stdout.write(JSON.stringify(out) + '\n');
    for (const c of clients.values()) c.close();
  },
  (err) => {
    process.stdout.write(JSON.stringify({fatal: String(err && err.stack ? err.stack : err), code: err && err.code}) + '\n');
    process.exit(1);
  },
);
