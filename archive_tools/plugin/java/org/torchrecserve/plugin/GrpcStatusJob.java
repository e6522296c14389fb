package org.torchrecserve.plugin;

import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import java.nio.charset.StandardCharsets;
import java.util.Map;
import org.pytorch.serve.job.GRPCJob;
import org.pytorch.serve.job.Job;

/**
 * A gRPC inference request whose refusal reaches its client as a gRPC status. TorchServe 0.12's
 * {@code GRPCJob} answers {@code Predictions} with status OK whatever status the handler set for
 * that request (the error's JSON as the prediction); only a whole batch's failure reaches its
 * {@code sendError}. Put on the model's queue in the request's place ({@link AdmissionQueue}),
 * this job turns the handler's status of 400 or more for its request into the call's error, with
 * the handler's message alone ({@link Internals#failGrpcCall}): TorchServe's own mapping gives 400
 * {@code INVALID_ARGUMENT}, 413 {@code RESOURCE_EXHAUSTED}, 503 {@code UNAVAILABLE}, 500 {@code INTERNAL}. The other requests
 * of the batch are answered as before.
 */
final class GrpcStatusJob extends Job {
    private final GRPCJob job;

    private GrpcStatusJob(GRPCJob job) {
        super(job.getModelName(), job.getModelVersion(), job.getCmd(), job.getPayload());
        this.job = job;
    }

    /** {@code job} as it goes on the queue: wrapped when it is a gRPC inference request. */
    static Job of(Job job) {
        return job instanceof GRPCJob && Internals.isInference(job.getCmd())
                ? new GrpcStatusJob((GRPCJob) job)
                : job;
    }

    @Override
    public void response(
            byte[] body, CharSequence contentType, int statusCode, String statusPhrase, Map<String, String> headers) {
        if (statusCode >= 400) {
            Internals.failGrpcCall(job, statusCode, message(body)); // the message alone
        } else {
            job.response(body, contentType, statusCode, statusPhrase, headers);
        }
    }

    @Override
    public void sendError(int status, String error) {
        job.sendError(status, error);
    }

    @Override
    public boolean isOpen() {
        return job.isOpen();
    }

    @Override
    public void setScheduled() {
        super.setScheduled();
        job.setScheduled(); // TorchServe's queue-time metric reads the request's own
    }

    @Override
    public long getBegin() {
        return job.getBegin();
    }

    /** The handler's message: the {@code message} of its JSON error (or a v2 {@code error}), else the body. */
    static String message(byte[] body) {
        String text = new String(body, StandardCharsets.UTF_8);
        try {
            JsonElement parsed = JsonParser.parseString(text);
            if (parsed.isJsonObject()) {
                JsonObject error = parsed.getAsJsonObject();
                for (String key : new String[] {"message", "error"}) {
                    if (error.has(key) && error.get(key).isJsonPrimitive()) {
                        return error.get(key).getAsString();
                    }
                }
            }
        } catch (RuntimeException e) { // not JSON: the body as it is
        }
        return text;
    }
}
