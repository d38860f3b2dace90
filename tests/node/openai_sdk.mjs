// The official `openai` Node SDK against the service's /v1, as a Node tool would use it: only `baseURL` changes.
// Run by tests/test_openai_node.py with OPENAI_BASE_URL, OPENAI_API_KEY, FT_BASE_MODEL and FT_TRAIN_JSONL set;
// prints one JSON object of what it saw, which the Python test checks.
import OpenAI, { toFile } from "openai";
import { readFile } from "node:fs/promises";

const client = new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: process.env.OPENAI_API_KEY, maxRetries: 0 });
const seen = {};

async function errorOf(call) {
  try {
    await call();
    return { raised: null };
  } catch (err) {
    const kinds = ["BadRequestError", "AuthenticationError", "PermissionDeniedError", "NotFoundError", "ConflictError",
                   "RateLimitError"];
    return { raised: kinds.find((k) => err instanceof OpenAI[k]) ?? err.constructor.name, status: err.status,
             param: err.param ?? null, code: err.code ?? null };
  }
}

const body = await readFile(process.env.FT_TRAIN_JSONL);
const file = await client.files.create({ file: await toFile(body, "train.jsonl"), purpose: "fine-tune" });
seen.file = { id: file.id, object: file.object, bytes: file.bytes, purpose: file.purpose };
let status = file.status;
for (let i = 0; i < 120 && status === "uploaded"; i++) {
  await new Promise((r) => setTimeout(r, 250));
  status = (await client.files.retrieve(file.id)).status;
}
seen.file.status = status;

const created = [];
for (const suffix of ["node-a", "node-b", "node-c"]) {
  const job = await client.fineTuning.jobs.create({
    model: process.env.FT_BASE_MODEL, training_file: file.id, suffix,
    method: { type: "supervised", supervised: { hyperparameters: { n_epochs: 1, batch_size: 8 } } },
  });
  created.push(job.id);
  await client.fineTuning.jobs.cancel(job.id);
}
seen.created = created;
const job = await client.fineTuning.jobs.retrieve(created[0]);
seen.job = { object: job.object, status: job.status, model: job.model, training_file: job.training_file,
             n_epochs: job.method?.supervised?.hyperparameters?.n_epochs ?? null };

seen.listed = [];
for await (const j of client.fineTuning.jobs.list({ limit: 2 })) seen.listed.push(j.id);
seen.events = [];
for await (const e of client.fineTuning.jobs.listEvents(created[0], { limit: 2 })) {
  seen.events.push({ id: e.id, object: e.object, created_at: e.created_at });
}
seen.models = [];
for await (const m of client.models.list()) seen.models.push(m.id);

seen.errors = {
  not_found: await errorOf(() => client.fineTuning.jobs.retrieve("job_00000000000000000000")),
  bad_param: await errorOf(() => client.fineTuning.jobs.create({
    model: process.env.FT_BASE_MODEL, training_file: file.id, hyperparameters: { n_epochs: 0 } })),
  dpo: await errorOf(() => client.fineTuning.jobs.create({
    model: process.env.FT_BASE_MODEL, training_file: file.id, method: { type: "dpo" } })),
  wrong_key: await errorOf(() => new OpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: "ftk_wrong",
                                              maxRetries: 0 }).models.list()),
};
// A cancelled job that a worker had started lets go of its file once its processes have stopped: until then the
// delete is a 409 (ConflictError), which a client waits out.
for (let i = 0; i < 240 && seen.deleted === undefined; i++) {
  try {
    seen.deleted = (await client.files.delete(file.id)).deleted;
  } catch (err) {
    if (!(err instanceof OpenAI.ConflictError)) throw err;
    seen.delete_conflicts = (seen.delete_conflicts ?? 0) + 1;
    await new Promise((r) => setTimeout(r, 500));
  }
}
// Every job on the file has ended now (the delete went through): cancelling one again is a conflict.
seen.errors.cancel_ended = await errorOf(() => client.fineTuning.jobs.cancel(created[0]));
console.log(JSON.stringify(seen));
