package org.torchrecserve.plugin;

import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import io.netty.handler.codec.http.QueryStringDecoder;
import java.io.File;
import java.io.IOException;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.regex.Pattern;
import org.pytorch.serve.archive.model.ModelNotFoundException;
import org.pytorch.serve.http.BadRequestException;
import org.pytorch.serve.http.ConflictStatusException;
import org.pytorch.serve.http.MethodNotAllowedException;
import org.pytorch.serve.servingsdk.Context;
import org.pytorch.serve.servingsdk.ModelServerEndpoint;
import org.pytorch.serve.servingsdk.annotations.Endpoint;
import org.pytorch.serve.servingsdk.annotations.helpers.EndpointTypes;
import org.pytorch.serve.servingsdk.http.Request;
import org.pytorch.serve.servingsdk.http.Response;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.ModelManager;
import org.pytorch.serve.wlm.WorkerThread;

/**
 * Publishing deltas to a served model, on the management port:
 *
 * <ul>
 *   <li>{@code POST /freshness/NAME[/VERSION]?delta=FILE}: {@code FILE} names a delta file directly
 *       inside the model store's {@code deltas} folder (bodies are not read: TorchServe 0.12 may
 *       release a plugin request's body before the plugin runs). A worker checks it whole, asked
 *       through the freshness protocol ({@link FreshnessCalls}) (base
 *       archive, next sequence, tables, dtypes, dims, ids, checksums); then it is copied into the
 *       model's delta log and flushed to disk, and only then answered 200. The workers apply it
 *       from the log at the model's pace (and swap in its dense weights, if it has some). Publishing the same delta again is answered as before,
 *       with nothing applied twice; anything wrong is a 4xx naming it, with nothing applied.
 *   <li>{@code POST /freshness/NAME[/VERSION]?rollback_to=SEQUENCE}: the tables as they were after
 *       that delta (0: the archive's rows). The request is recorded beside the log and answered at
 *       once; the model's writer restores the rows each delta overwrote (kept in the log) at the
 *       model's pace, then the later deltas leave the log (moved aside) and the next publish
 *       continues from there. Publishes meanwhile are refused (409); the state shows
 *       {@code rolling_back_to} until it is done.
 *   <li>{@code GET /freshness/NAME[/VERSION]}: the base fingerprint, the log's head, the sequence
 *       applied to the tables (every worker maps the same tables, so it is every worker's), rows
 *       applied, and the workers, each with the delta whose dense weights it serves (dense
 *       weights are each worker's own, swapped whole once their delta's rows are applied).
 * </ul>
 */
@Endpoint(
        urlPattern = "freshness",
        endpointType = EndpointTypes.MANAGEMENT,
        description = "Publish embedding-row deltas to a served model, and read its freshness")
public final class FreshnessEndpoint extends ModelServerEndpoint {
    private static final Pattern FILE_NAME = Pattern.compile("[A-Za-z0-9][A-Za-z0-9_.-]*");
    private final Map<String, Object> publishing = new ConcurrentHashMap<>();

    public FreshnessEndpoint() {
        Contract.require();
    }

    @Override
    public void doGet(Request req, Response rsp, Context ctx) throws IOException {
        handle(req, rsp, false);
    }

    @Override
    public void doPost(Request req, Response rsp, Context ctx) throws IOException {
        handle(req, rsp, true);
    }

    @Override
    public void doPut(Request req, Response rsp, Context ctx) throws IOException {
        Replies.error(rsp, new MethodNotAllowedException());
    }

    @Override
    public void doDelete(Request req, Response rsp, Context ctx) throws IOException {
        Replies.error(rsp, new MethodNotAllowedException());
    }

    private void handle(Request req, Response rsp, boolean publish) throws IOException {
        try {
            QueryStringDecoder query = new QueryStringDecoder(req.getRequestURI());
            String[] path = query.path().split("/"); // ["", "freshness", name, version?]
            if (path.length < 3 || path.length > 4) {
                throw new BadRequestException("use /freshness/NAME or /freshness/NAME/VERSION");
            }
            Model model = ModelsEndpoint.model(path[2], path.length == 4 ? path[3] : null);
            File log = Freshness.logDir(model.getModelName(), model.getModelDir());
            if (log == null) {
                throw new ConflictStatusException(
                        Guard.label(model) + " " + Freshness.whyNoLog(model.getModelDir()));
            }
            if (!new File(model.getModelDir(), ArchiveFiles.LOG_POINTER).isFile()) { // its workers would not answer
                throw new ConflictStatusException(Guard.label(model) + " has no delta log named: it was not"
                        + " registered through the plugin's /models (e.g. loaded at the server's start);"
                        + " register it through POST /models to publish deltas");
            }
            String rollbackTo = ModelsEndpoint.param(query, "rollback_to", null);
            if (publish && rollbackTo != null) {
                rollback(model, rollbackTo, rsp);
            } else if (publish) {
                publish(model, log, ModelsEndpoint.param(query, "delta", null), rsp);
            } else {
                state(model, log, rsp);
            }
        } catch (Exception e) {
            Replies.error(rsp, e);
        }
    }

    private void publish(Model model, File log, String name, Response rsp) throws Exception {
        if (name == null) {
            throw new BadRequestException("delta: required, the name of a file in " + Freshness.deltasDir());
        }
        if (!FILE_NAME.matcher(name).matches()) {
            throw new BadRequestException("delta: must name a file directly inside " + Freshness.deltasDir()
                    + ", got '" + name + "'; paths are refused");
        }
        File delta = new File(Freshness.deltasDir(), name);
        if (!delta.isFile()) {
            throw new ModelNotFoundException("delta: no '" + name + "' in " + Freshness.deltasDir());
        }
        synchronized (publishing.computeIfAbsent(Guard.label(model), k -> new Object())) {
            FreshnessCalls.Answer checked = FreshnessCalls.check(model, delta);
            if (checked.status() != 200) {
                Replies.json(rsp, checked.status(), Replies.GSON.toJson(checked.body()));
                return;
            }
            long sequence = checked.body().get("sequence").getAsLong();
            boolean duplicate = checked.body().get("duplicate").getAsBoolean();
            if (!duplicate) {
                Freshness.append(delta, log, sequence);
            }
            Map<String, Object> answer = new LinkedHashMap<>();
            answer.put("model", model.getModelName());
            answer.put("version", model.getVersion());
            answer.put("sequence", sequence);
            answer.put("rows", checked.body().get("rows").getAsLong());
            answer.put("duplicate", duplicate);
            answer.put("log", log.getPath());
            Replies.json(rsp, 200, Replies.GSON.toJson(answer));
        }
    }

    private void rollback(Model model, String to, Response rsp) throws Exception {
        long sequence;
        try {
            sequence = Long.parseLong(to);
        } catch (NumberFormatException e) {
            throw new BadRequestException("rollback_to: must be a sequence number, got '" + to + "'");
        }
        synchronized (publishing.computeIfAbsent(Guard.label(model), k -> new Object())) {
            FreshnessCalls.Answer answer = FreshnessCalls.rollback(model, sequence);
            Replies.json(rsp, answer.status(), Replies.GSON.toJson(answer.body()));
        }
    }

    private void state(Model model, File log, Response rsp) throws Exception {
        FreshnessCalls.Answer asked = FreshnessCalls.state(model);
        if (asked.status() != 200) {
            Replies.json(rsp, asked.status(), Replies.GSON.toJson(asked.body()));
            return;
        }
        JsonObject state = asked.body();
        Map<Long, JsonObject> notes = new HashMap<>(); // what each worker serves, by pid
        JsonElement noted = state.remove("workers");
        if (noted != null && noted.isJsonArray()) {
            for (JsonElement note : noted.getAsJsonArray()) {
                notes.put(note.getAsJsonObject().get("pid").getAsLong(), note.getAsJsonObject());
            }
        }
        JsonObject answer = new JsonObject();
        answer.addProperty("model", model.getModelName());
        answer.addProperty("version", model.getVersion());
        answer.addProperty("log", log.getPath());
        for (Map.Entry<String, JsonElement> entry : state.entrySet()) {
            answer.add(entry.getKey(), entry.getValue());
        }
        JsonArray workers = new JsonArray();
        for (WorkerThread worker : ModelManager.getInstance().getWorkers(model.getModelVersionName())) {
            JsonObject entry = new JsonObject();
            entry.addProperty("pid", worker.getPid());
            entry.addProperty("status", worker.getState().toString());
            entry.add("applied_sequence", state.get("applied_sequence"));
            JsonObject note = notes.get((long) worker.getPid());
            if (note != null) {
                entry.add("dense_sequence", note.get("dense_sequence"));
                entry.add("dense_swap_s", note.get("dense_swap_s"));
            }
            workers.add(entry);
        }
        answer.add("workers", workers);
        Replies.json(rsp, 200, Replies.GSON.toJson(answer));
    }
}
