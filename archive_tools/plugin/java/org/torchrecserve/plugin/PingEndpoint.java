package org.torchrecserve.plugin;

import java.io.IOException;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.pytorch.serve.servingsdk.Context;
import org.pytorch.serve.servingsdk.ModelServerEndpoint;
import org.pytorch.serve.servingsdk.annotations.Endpoint;
import org.pytorch.serve.servingsdk.annotations.helpers.EndpointTypes;
import org.pytorch.serve.servingsdk.http.Request;
import org.pytorch.serve.servingsdk.http.Response;

/**
 * {@code GET /ping} that reflects what serving needs: 200 {"status": "Healthy"} when every worker of
 * every model is ready and answering; else 503 {"status": "Unhealthy", "problems": [...]}, naming
 * the model and worker (one running a batch for over half its hang threshold, one being restarted
 * after it stopped answering, a model short of its minimum of ready workers). TorchServe's own
 * ping stays "Healthy" while a worker hangs.
 */
@Endpoint(
        urlPattern = "ping",
        endpointType = EndpointTypes.INFERENCE,
        description = "health: every model's workers ready and answering")
public final class PingEndpoint extends ModelServerEndpoint {
    public PingEndpoint() {
        Contract.require();
        Guard.get();
    }

    @Override
    public void doGet(Request req, Response rsp, Context ctx) throws IOException {
        List<String> problems = Guard.get().problems();
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("status", problems.isEmpty() ? "Healthy" : "Unhealthy");
        if (!problems.isEmpty()) {
            body.put("problems", problems);
        }
        Replies.json(rsp, problems.isEmpty() ? 200 : 503, Replies.GSON.toJson(body));
    }
}
