package org.torchrecserve.plugin;

import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import io.netty.handler.codec.http.QueryStringDecoder;
import java.io.File;
import java.io.IOException;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.TimeUnit;
import java.util.regex.Pattern;
import org.pytorch.serve.archive.model.Manifest;
import org.pytorch.serve.archive.model.ModelArchive;
import org.pytorch.serve.archive.model.ModelConfig;
import org.pytorch.serve.archive.model.ModelNotFoundException;
import org.pytorch.serve.http.BadRequestException;
import org.pytorch.serve.http.ConflictStatusException;
import org.pytorch.serve.http.InvalidModelVersionException;
import org.pytorch.serve.http.MethodNotAllowedException;
import org.pytorch.serve.http.ServiceUnavailableException;
import org.pytorch.serve.http.StatusResponse;
import org.pytorch.serve.http.messages.DescribeModelResponse;
import org.pytorch.serve.http.messages.RegisterModelRequest;
import org.pytorch.serve.servingsdk.Context;
import org.pytorch.serve.servingsdk.ModelServerEndpoint;
import org.pytorch.serve.servingsdk.annotations.Endpoint;
import org.pytorch.serve.servingsdk.annotations.helpers.EndpointTypes;
import org.pytorch.serve.servingsdk.http.Request;
import org.pytorch.serve.servingsdk.http.Response;
import org.pytorch.serve.util.ApiUtils;
import org.pytorch.serve.util.ConfigManager;
import org.pytorch.serve.util.JsonUtils;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.ModelManager;
import org.pytorch.serve.wlm.ModelVersionedRefs;
import org.pytorch.serve.wlm.WorkerThread;

/**
 * TorchServe's management API ({@code /models}) with the same calls, parameters and answers,
 * run by this plugin so that:
 *
 * <ul>
 *   <li>it runs on TorchServe's task threads, not its Netty threads: a synchronous register or
 *       scale-up (which waits for workers to load) no longer stalls the inference connections
 *       that share those threads;
 *   <li>scale-down and unregister drain ({@link Drain}): no request is lost or failed;
 *   <li>{@code url} names an archive or folder directly inside the model store, nothing else
 *       (TorchServe also takes absolute folder paths and URLs); a duplicate is refused with 409
 *       before anything is unpacked;
 *   <li>{@code initial_workers} is honoured when given, 0 included (TorchServe lets an archive's
 *       minWorkers override it).
 * </ul>
 */
@Endpoint(
        urlPattern = "models",
        endpointType = EndpointTypes.MANAGEMENT,
        description = "TorchServe's management API, with drained scale-down and a locked model store")
public final class ModelsEndpoint extends ModelServerEndpoint {
    private static final Pattern STORE_NAME = Pattern.compile("[A-Za-z0-9][A-Za-z0-9_.-]*");
    private final Map<String, Object> modelLocks = new ConcurrentHashMap<>();

    public ModelsEndpoint() {
        Contract.require();
        Guard.get();
    }

    @Override
    public void doGet(Request req, Response rsp, Context ctx) throws IOException {
        handle(req, rsp, "GET");
    }

    @Override
    public void doPost(Request req, Response rsp, Context ctx) throws IOException {
        handle(req, rsp, "POST");
    }

    @Override
    public void doPut(Request req, Response rsp, Context ctx) throws IOException {
        handle(req, rsp, "PUT");
    }

    @Override
    public void doDelete(Request req, Response rsp, Context ctx) throws IOException {
        handle(req, rsp, "DELETE");
    }

    private void handle(Request req, Response rsp, String method) throws IOException {
        try {
            QueryStringDecoder query = new QueryStringDecoder(req.getRequestURI());
            String[] path = query.path().split("/"); // ["", "models", name?, version?, "set-default"?]
            String name = path.length > 2 ? path[2] : null;
            String version = path.length > 3 ? path[3] : null;
            if (method.equals("GET") && name == null) {
                list(query, rsp);
            } else if (method.equals("GET") && path.length <= 4) {
                describe(name, version, query, rsp);
            } else if (method.equals("POST") && name == null) {
                register(req, query, rsp);
            } else if (method.equals("PUT") && path.length == 5 && path[4].equals("set-default")) {
                Replies.status(rsp, new StatusResponse(ApiUtils.setDefault(name, version), 200));
            } else if (method.equals("PUT") && name != null && path.length <= 4) {
                scale(name, version != null ? version : param(query, "model_version", null), query, rsp);
            } else if (method.equals("DELETE") && name != null && path.length <= 4) {
                unregister(name, version, rsp);
            } else {
                throw new MethodNotAllowedException();
            }
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            Replies.error(rsp, 503, "ServiceUnavailableException", "interrupted");
        } catch (Exception e) {
            Replies.error(rsp, e);
        }
    }

    private void list(QueryStringDecoder query, Response rsp) throws IOException {
        int limit = intParam(query, "limit", 100);
        int token = intParam(query, "next_page_token", 0);
        Replies.object(rsp, ApiUtils.getModelList(limit, token));
    }

    private void describe(String name, String version, QueryStringDecoder query, Response rsp) throws Exception {
        boolean customized = Boolean.parseBoolean(param(query, "customized", "false"));
        List<DescribeModelResponse> description = ApiUtils.getModelDescription(name, version);
        if (customized && !"all".equals(version)) {
            byte[] body = new DescribeJob(name, version).call(model(name, version));
            if (body.length > 0 && description.size() == 1) {
                description.get(0).setCustomizedMetadata(body);
            }
        }
        // TorchServe's description, and each version's admission control beside it
        JsonArray described = JsonUtils.GSON_PRETTY.toJsonTree(description).getAsJsonArray();
        for (JsonElement entry : described) {
            JsonObject model = entry.getAsJsonObject();
            Model served = ModelManager.getInstance().getModel(name, model.get("modelVersion").getAsString());
            if (served != null) {
                model.add("admission", Replies.GSON.toJsonTree(Guard.get().queue(served).describe()));
            }
        }
        Replies.json(rsp, 200, Replies.GSON.toJson(described));
    }

    private void register(Request req, QueryStringDecoder query, Response rsp) throws Exception {
        if (hasBody(req)) {
            throw new BadRequestException(
                    "register takes its parameters in the query string (url=NAME&initial_workers=1...), not in a body");
        }
        RegisterModelRequest request = new RegisterModelRequest(query); // TorchServe's parsing and defaults
        String url = request.getModelUrl();
        if (url == null) {
            throw new BadRequestException("Parameter url is required.");
        }
        File entry = storeEntry(url);
        Integer initialWorkers = query.parameters().containsKey("initial_workers")
                ? intParam(query, "initial_workers", 0) : null;
        if (initialWorkers != null && initialWorkers < 0) {
            throw new BadRequestException("initial_workers: must be 0 or more, got " + initialWorkers);
        }
        refuseDuplicate(entry, request.getModelName());

        ModelManager manager = ModelManager.getInstance();
        ModelArchive archive = registerArchive(manager, request, url);
        String name = archive.getModelName();
        String version = archive.getModelVersion();
        Freshness.writePointer(name, archive.getModelDir()); // workers replay the delta log at load
        try { // admission control before any worker polls
            Guard.get().queue(model(name, version), guardOverrides(query));
        } catch (BadRequestException e) {
            manager.unregisterModel(name, version);
            throw e;
        }

        int minWorkers = request.getInitialWorkers(); // the server's default_workers_per_model if not given
        int maxWorkers = minWorkers;
        ModelConfig modelConfig = archive.getModelConfig();
        if (initialWorkers != null) {
            minWorkers = maxWorkers = initialWorkers;
        } else if (modelConfig != null && modelConfig.getMinWorkers() > 0
                && modelConfig.getMaxWorkers() >= modelConfig.getMinWorkers()) {
            minWorkers = modelConfig.getMinWorkers();
            maxWorkers = modelConfig.getMaxWorkers();
        }
        if (minWorkers == 0) {
            Replies.status(rsp, new StatusResponse(
                    "Model \"" + name + "\" Version: " + version
                            + " registered with 0 initial workers. Use scale workers API to add workers for the model.",
                    200));
            return;
        }
        Replies.status(rsp, ApiUtils.updateModelWorkers(
                name, version, minWorkers, maxWorkers, request.getSynchronous(), true,
                f -> {
                    manager.unregisterModel(name, version);
                    return null;
                }));
    }

    /** TorchServe's own registration of the archive, with its defaults for what the call leaves out. */
    private static ModelArchive registerArchive(ModelManager manager, RegisterModelRequest request, String url)
            throws Exception {
        ConfigManager config = ConfigManager.getInstance();
        Manifest.RuntimeType runtime;
        try {
            runtime = request.getRuntime() == null ? null : Manifest.RuntimeType.fromValue(request.getRuntime());
        } catch (IllegalArgumentException e) {
            throw new BadRequestException(e);
        }
        return manager.registerModel(
                url,
                request.getModelName(),
                runtime,
                request.getHandler(),
                request.getBatchSize(),
                request.getMaxBatchDelay(),
                request.getResponseTimeout() == -1 ? config.getDefaultResponseTimeout() : request.getResponseTimeout(),
                request.getStartupTimeout() == -1 ? config.getDefaultStartupTimeout() : request.getStartupTimeout(),
                null,
                false,
                false,
                false);
    }

    private void scale(String name, String version, QueryStringDecoder query, Response rsp) throws Exception {
        int minWorkers = intParam(query, "min_worker", 1);
        int maxWorkers = intParam(query, "max_worker", minWorkers);
        boolean synchronous = Boolean.parseBoolean(param(query, "synchronous", "false"));
        if (minWorkers < 0 || maxWorkers < minWorkers) {
            throw new BadRequestException("max_worker cannot be less than min_worker.");
        }
        Model model = model(name, version);
        synchronized (lock(name)) {
            AdmissionQueue queue = Guard.get().queue(model);
            long timeoutMs = TimeUnit.SECONDS.toMillis(queue.settings.drainTimeoutS());
            List<WorkerThread> workers = ModelManager.getInstance().getWorkers(model.getModelVersionName());
            if (maxWorkers < workers.size()) {
                if (maxWorkers == 0) { // nobody will be left to serve what is queued: serve it first
                    queue.close(Guard.label(model) + " is being scaled to 0 workers");
                    waitForQueuedRequests(queue, timeoutMs);
                }
                Drain.stop(model, queue, new ArrayList<>(workers.subList(maxWorkers, workers.size())), timeoutMs);
            }
            StatusResponse status = ApiUtils.updateModelWorkers(
                    name, model.getVersion(), minWorkers, maxWorkers, synchronous, false, null);
            if (maxWorkers == 0) {
                queue.refuseQueued(Guard.label(model) + " has 0 workers");
                queue.open();
            }
            Replies.status(rsp, status);
        }
    }

    private void unregister(String name, String version, Response rsp) throws Exception {
        Model model = model(name, version);
        ModelVersionedRefs versions = versions(name);
        if (versions.getAllVersions().size() > 1 && model.getVersion().equals(versions.getDefaultVersion())) {
            throw new InvalidModelVersionException("Cannot remove default version for model " + name);
        }
        synchronized (lock(name)) {
            AdmissionQueue queue = Guard.get().queue(model);
            long timeoutMs = TimeUnit.SECONDS.toMillis(queue.settings.drainTimeoutS());
            queue.close(Guard.label(model) + " is being unregistered");
            try {
                waitForQueuedRequests(queue, timeoutMs);
                Drain.stop(model, queue, ModelManager.getInstance().getWorkers(model.getModelVersionName()), timeoutMs);
                ApiUtils.unregisterModel(name, model.getVersion());
            } catch (Exception e) {
                queue.open();
                throw e;
            }
            queue.refuseQueued(Guard.label(model) + " was unregistered");
        }
        Replies.status(rsp, new StatusResponse("Model \"" + name + "\" unregistered", 200));
    }

    /** The archive or folder ``url`` names in the model store; anything else is refused. */
    private static File storeEntry(String url) throws ModelNotFoundException {
        File store = new File(ConfigManager.getInstance().getModelStore()).getAbsoluteFile();
        if (!STORE_NAME.matcher(url).matches() || url.contains("..")) {
            throw new BadRequestException(
                    "url: must be the name of an archive or folder directly inside the model store "
                            + store + " (e.g. criteo.mar), got '" + url + "'; paths and URLs are refused");
        }
        File entry = new File(store, url);
        if (!entry.exists()) {
            throw new ModelNotFoundException("url: no '" + url + "' in the model store " + store);
        }
        return entry;
    }

    /** A 409 before anything is unpacked, when the archive's name and version are registered. */
    private static void refuseDuplicate(File entry, String nameParam) {
        JsonObject manifest = ArchiveFiles.manifestModel(entry);
        if (manifest == null) {
            return; // unreadable here: TorchServe's own check still applies
        }
        String name = nameParam != null && !nameParam.isEmpty() ? nameParam : string(manifest, "modelName");
        String version = string(manifest, "modelVersion");
        version = version == null ? "1.0" : version;
        for (Map.Entry<String, ModelVersionedRefs> model : ModelManager.getInstance().getAllModels()) {
            if (model.getKey().equals(name) && model.getValue().getVersionModel(version) != null) {
                throw new ConflictStatusException(
                        "Model version " + version + " is already registered for model " + name);
            }
        }
    }

    private static String string(JsonObject object, String key) {
        return object != null && object.has(key) && !object.get(key).isJsonNull() ? object.get(key).getAsString() : null;
    }

    private static void waitForQueuedRequests(AdmissionQueue queue, long timeoutMs) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(timeoutMs);
        while (queue.hasInferenceJobs() && System.nanoTime() < deadline) {
            Thread.sleep(5);
        }
    }

    static Model model(String name, String version) throws Exception {
        Model model = ModelManager.getInstance().getModel(name, version);
        if (model == null) {
            throw new ModelNotFoundException("Model not found: " + name);
        }
        return model;
    }

    private static ModelVersionedRefs versions(String name) throws ModelNotFoundException {
        for (Map.Entry<String, ModelVersionedRefs> model : ModelManager.getInstance().getAllModels()) {
            if (model.getKey().equals(name)) {
                return model.getValue();
            }
        }
        throw new ModelNotFoundException("Model not found: " + name);
    }

    private Object lock(String name) {
        return modelLocks.computeIfAbsent(name, k -> new Object());
    }

    /** TorchServe reads register parameters from a JSON body; plugins cannot read bodies reliably. */
    private static boolean hasBody(Request req) {
        for (String header : req.getHeaderNames()) {
            if (header.equalsIgnoreCase("content-type")) {
                return req.getContentType().toLowerCase().startsWith("application/json");
            }
        }
        return false;
    }

    private static Map<String, String> guardOverrides(QueryStringDecoder query) {
        Map<String, String> overrides = new java.util.HashMap<>();
        for (String key : GuardSettings.KEYS) {
            String value = param(query, key, null);
            if (value != null) {
                overrides.put(key, value);
            }
        }
        return overrides;
    }

    static String param(QueryStringDecoder query, String name, String fallback) {
        List<String> values = query.parameters().get(name);
        return values == null || values.isEmpty() ? fallback : values.get(0);
    }

    private static int intParam(QueryStringDecoder query, String name, int fallback) {
        String value = param(query, name, null);
        if (value == null) {
            return fallback;
        }
        try {
            return Integer.parseInt(value);
        } catch (NumberFormatException e) {
            throw new BadRequestException(name + ": must be an integer, got '" + value + "'");
        }
    }
}
