package org.torchrecserve.plugin;

import com.google.gson.Gson;
import com.google.gson.GsonBuilder;
import java.io.IOException;
import java.io.OutputStream;
import java.nio.charset.StandardCharsets;
import org.pytorch.serve.archive.DownloadArchiveException;
import org.pytorch.serve.archive.model.ModelException;
import org.pytorch.serve.archive.model.ModelNotFoundException;
import org.pytorch.serve.archive.model.ModelVersionNotFoundException;
import org.pytorch.serve.http.BadRequestException;
import org.pytorch.serve.http.ConflictStatusException;
import org.pytorch.serve.http.ErrorResponse;
import org.pytorch.serve.http.MethodNotAllowedException;
import org.pytorch.serve.http.RequestTimeoutException;
import org.pytorch.serve.http.ResourceNotFoundException;
import org.pytorch.serve.http.ServiceUnavailableException;
import org.pytorch.serve.http.StatusResponse;
import org.pytorch.serve.servingsdk.http.Response;
import org.pytorch.serve.util.JsonUtils;

/** JSON answers in TorchServe's own shapes, and its mapping of exceptions to status codes. */
final class Replies {
    /** Our own messages, quotes left as they are (TorchServe's Gson escapes them for HTML). */
    static final Gson GSON = new GsonBuilder().setPrettyPrinting().disableHtmlEscaping().create();
    static final Gson COMPACT = new GsonBuilder().disableHtmlEscaping().create();

    private Replies() {}

    static void json(Response rsp, int status, String json) throws IOException {
        rsp.setStatus(status);
        rsp.setContentType("application/json");
        try (OutputStream out = rsp.getOutputStream()) {
            out.write((json + "\n").getBytes(StandardCharsets.UTF_8));
        }
    }

    static void object(Response rsp, Object body) throws IOException {
        json(rsp, 200, JsonUtils.GSON_PRETTY.toJson(body));
    }

    static void status(Response rsp, StatusResponse status) throws IOException {
        int code = status.getHttpResponseCode();
        if (code >= 200 && code < 300) {
            json(rsp, code, JsonUtils.GSON_PRETTY_EXPOSED.toJson(status));
        } else {
            Throwable cause = status.getE();
            String type = cause == null ? "InternalServerException" : cause.getClass().getSimpleName();
            error(rsp, code == 413 ? 507 : code, type, status.getStatus());
        }
    }

    static void error(Response rsp, int status, String type, String message) throws IOException {
        json(rsp, status, GSON.toJson(new ErrorResponse(status, type, message)));
    }

    static void error(Response rsp, Throwable t) throws IOException {
        error(rsp, statusOf(t), t.getClass().getSimpleName(), t.getMessage());
    }

    /** As TorchServe's HttpRequestHandler maps them. */
    static int statusOf(Throwable t) {
        if (t instanceof ResourceNotFoundException
                || t instanceof ModelNotFoundException
                || t instanceof ModelVersionNotFoundException) {
            return 404;
        }
        if (t instanceof ConflictStatusException) {
            return 409;
        }
        if (t instanceof BadRequestException || t instanceof ModelException || t instanceof DownloadArchiveException) {
            return 400;
        }
        if (t instanceof RequestTimeoutException) {
            return 408;
        }
        if (t instanceof MethodNotAllowedException) {
            return 405;
        }
        if (t instanceof ServiceUnavailableException) {
            return 503;
        }
        if (t instanceof IllegalArgumentException) { // InvalidModelVersionException: the default version
            return 403;
        }
        return 500;
    }
}
